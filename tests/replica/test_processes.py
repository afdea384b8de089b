"""Harness process helpers: ports that stay free until their server binds them."""

from __future__ import annotations

import socket

from replica.processes import _ephemeral_low, free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    # An outgoing connection's local port comes from the ephemeral range; a port below
    # it can only be taken by another listener.
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # spread, not one port handed out again and again
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))



def test_free_port_never_hands_out_one_port_twice_before_servers_bind() -> None:
    # A 32-sim fleet picks ~100 ports before any of its servers binds one: none repeats.
    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
