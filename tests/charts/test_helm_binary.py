"""The chart under the real helm binary (v3.19.0, installed into the virtualenv by
scripts/setup.sh): `helm lint --strict` passes, and `helm template` renders exactly what
the in-process renderer (scripts/chart_template.py, which every other chart test uses)
renders, for the default values and every ci/*.yaml. Generated secrets are random per
render, so Secret data is masked before comparing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import chart_template  # noqa: E402

CHART = REPO / "charts" / "cacheroute"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "llm"
NAMESPACE = "inference"
HELM_TIMEOUT_S = 120

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> Path:
    """The helm binary; its absence is a failure: setup installs it."""
    path = chart_template.helm_binary()
    assert path.is_file() and os.access(path, os.X_OK), (
        f"no helm binary at {path}: run scripts/setup.sh, which installs it there")
    return path


def run_helm(helm: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *map(str, args)], capture_output=True, text=True,
                          timeout=HELM_TIMEOUT_S, check=False)


def values_flags(values: Path | None) -> list[str | Path]:
    return ["-f", values] if values else []


def masked(objs: Iterable[Obj]) -> dict[tuple[str, str], Obj]:
    """(kind, name) -> object, with every Secret value replaced by a marker."""
    out: dict[tuple[str, str], Obj] = {}
    for obj in objs:
        if obj["kind"] == "Secret":
            for field in ("data", "stringData"):
                if field in obj:
                    obj[field] = {key: "<masked>" for key in obj[field]}
        key = (obj["kind"], obj["metadata"]["name"])
        assert key not in out, f"rendered twice: {key}"
        out[key] = obj
    return out


def differences(helm_objs: Iterable[Obj], python_objs: Iterable[Obj]) -> list[str]:
    """What differs between two renders, one line per object (empty when equal)."""
    ours, theirs = masked(python_objs), masked(helm_objs)
    out = [f"only helm renders {k}" for k in sorted(theirs.keys() - ours.keys())]
    out += [f"only the Python renderer renders {k}" for k in sorted(ours.keys() - theirs.keys())]
    for key in sorted(ours.keys() & theirs.keys()):
        if ours[key] != theirs[key]:
            out.append(f"{key}: helm {json.dumps(theirs[key], sort_keys=True)} != "
                       f"python {json.dumps(ours[key], sort_keys=True)}")
    return out


def helm_template(chart: Path, values: Path | None) -> list[Obj]:
    return chart_template.helm_template(values_flags(values)[1:], chart=chart, name=RELEASE,
                                        namespace=NAMESPACE)


def python_template(values: Path | None) -> list[Obj]:
    rendered = chart_template.render(chart_template.load_values(values_flags(values)[1:]),
                                     name=RELEASE, namespace=NAMESPACE)
    return chart_template.manifests(rendered)


CASES = [None, *CI_VALUES]
CASE_IDS = ["default", *(p.name for p in CI_VALUES)]


def test_helm_is_the_pinned_version(helm: Path) -> None:
    result = run_helm(helm, "version", "--short")
    assert result.returncode == 0 and result.stdout.startswith("v3.19.0+"), result


@pytest.mark.parametrize("values", CASES, ids=CASE_IDS)
def test_helm_lint_strict_passes(helm: Path, values: Path | None) -> None:
    result = run_helm(helm, "lint", "--strict", CHART, *values_flags(values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    # lint reports a template's own `fail` only as [INFO]: it must not be there either.
    assert "Fail:" not in result.stdout + result.stderr


def test_helm_lint_strict_fails_on_a_template_error(helm: Path, tmp_path: Path) -> None:
    chart = Path(shutil.copytree(CHART, tmp_path / "cacheroute"))
    (chart / "templates" / "broken.yaml").write_text("metadata: {{ .Values.nope.deeper }}\n")
    result = run_helm(helm, "lint", "--strict", chart)
    assert result.returncode != 0
    assert "broken.yaml" in result.stdout + result.stderr


@pytest.mark.parametrize("values", CASES, ids=CASE_IDS)
def test_helm_template_renders_what_the_python_renderer_renders(
        helm: Path, values: Path | None) -> None:
    assert differences(helm_template(CHART, values), python_template(values)) == []


def test_a_render_difference_is_reported(helm: Path, tmp_path: Path) -> None:
    chart = Path(shutil.copytree(CHART, tmp_path / "cacheroute"))
    service = chart / "templates" / "gateway-service.yaml"
    text = service.read_text()
    assert "spec:\n" in text
    service.write_text(text.replace("spec:\n", "spec:\n  sessionAffinity: ClientIP\n", 1))
    found = differences(helm_template(chart, None), python_template(None))
    assert len(found) == 1 and found[0].startswith("('Service', 'llm-cacheroute-gateway')")
    assert "ClientIP" in found[0]


def test_masking_keeps_secret_keys_and_everything_else() -> None:
    secret = {"kind": "Secret", "metadata": {"name": "s"}, "type": "Opaque",
              "data": {"a": "eA=="}, "stringData": {"b": "y"}}
    [(key, obj)] = masked([secret]).items()
    assert key == ("Secret", "s")
    assert obj == {"kind": "Secret", "metadata": {"name": "s"}, "type": "Opaque",
                   "data": {"a": "<masked>"}, "stringData": {"b": "<masked>"}}
    assert differences([{"kind": "Secret", "metadata": {"name": "s"}, "data": {"a": "1"}}],
                       [{"kind": "Secret", "metadata": {"name": "s"}, "data": {"z": "1"}}])
