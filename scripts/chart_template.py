"""Render the Helm chart offline, as `helm template` does, and validate what it renders.

    python scripts/chart_template.py [CHART] [-f VALUES]... [--name N] [--namespace NS]
                                     [--validate] [--kube-version 1.27.0] [--lint]

Rendering runs Helm's own Go engine (Helm v4 SDK through the helm-python-sdk wheel), so
templates, sprig functions and values.schema.json behave as under the `helm` binary,
in process and without a cluster. The binary itself (helm v3.19.0) is installed into the
virtualenv by scripts/setup.sh (`helm_binary()`), and tests/charts/test_helm_binary.py
holds this renderer to it: `helm lint --strict` passes and `helm template` renders the
same objects, for the default values and every ci/*.yaml. `--validate` checks every
rendered object against the Kubernetes OpenAPI schemas that kubernetes-validate ships
(offline, strict: an unknown field is an error); objects of kinds without a schema
there (CRDs such as ServiceMonitor) are listed as unchecked.

Needs: pip install helm-python-sdk==0.2.2 kubernetes-validate==1.37.0
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "cacheroute"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest
# kubernetes-validate knows: a field must exist in both.
KUBE_VERSIONS = ("1.27.0", "1.37.0")


def helm_binary() -> Path:
    """The helm binary scripts/setup.sh installs beside this virtualenv's python."""
    return Path(sys.prefix) / "bin" / "helm"


def helm_template(values_files: Sequence[str | Path] = (), *, chart: Path = CHART,
                  name: str = "cacheroute", namespace: str = "default",
                  api_versions: Sequence[str] = (), timeout_s: float = 120) -> list[dict[str, Any]]:
    """Every object `helm template` (the real binary) renders; HelmTemplateError if it fails.

    `api_versions` are the cluster APIs to assume (`--api-versions`), such as
    "monitoring.coreos.com/v1/ServiceMonitor": the in-process renderer cannot set them.
    """
    cmd = [str(helm_binary()), "template", name, str(chart), "--namespace", namespace]
    for f in values_files:
        cmd += ["-f", str(f)]
    for api in api_versions:
        cmd += ["--api-versions", api]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise HelmTemplateError(result.stderr.strip())
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


class HelmTemplateError(Exception):
    """`helm template` refused to render; the message is helm's."""


def load_values(files: Iterable[str | Path]) -> dict[str, Any]:
    """Values files merged left to right, as repeated `helm -f` merges them."""
    merged: dict[str, Any] = {}
    for f in files:
        data = yaml.safe_load(Path(f).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{f}: a values file must hold a mapping")
        _deep_merge(merged, data)
    return merged


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def render(values: Mapping[str, Any] | None = None, *, chart: Path = CHART,
           name: str = "cacheroute", namespace: str = "default") -> dict[str, str]:
    """Template path -> rendered text, for a first install (Helm's own engine, offline)."""
    import helm_python as helm

    with helm.Chart.load(str(chart)) as loaded:
        return loaded.render(dict(values or {}), name=name, namespace=namespace,
                             is_install=True, revision=1)


def merged_values(values: Mapping[str, Any] | None = None, *, chart: Path = CHART) -> dict[str, Any]:
    """The chart's defaults with `values` over them: what templates see as .Values."""
    import helm_python as helm

    with helm.Chart.load(str(chart)) as loaded:
        return loaded.merge_values(dict(values or {}))


def manifests(rendered: Mapping[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object in the rendered templates (NOTES.txt excluded), in order."""
    out: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(rendered[path]):
            if doc:
                out.append(doc)
    return out


def notes(rendered: Mapping[str, str]) -> str:
    """The rendered NOTES.txt."""
    return next((text for path, text in rendered.items() if path.endswith("NOTES.txt")), "")


def validate(objects: Sequence[Mapping[str, Any]],
             kube_versions: Sequence[str] = KUBE_VERSIONS) -> tuple[list[str], list[str]]:
    """(errors, unchecked): schema errors per object, and the objects no schema covers."""
    import kubernetes_validate

    errors: list[str] = []
    unchecked: list[str] = []
    for obj in objects:
        label = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        for version in kube_versions:
            try:
                kubernetes_validate.validate(dict(obj), version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unchecked.append(label)
                break
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{label} (Kubernetes {version}): {e.message} at "
                              f"{'.'.join(str(p) for p in e.path)}")
    return errors, unchecked


def lint(values: Mapping[str, Any] | None = None, *, chart: Path = CHART) -> list[str]:
    """`helm lint --strict` findings of warning or error severity, as text."""
    import helm_python as helm

    report = helm.lint(str(chart), dict(values or {}), strict=True)
    return [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chart", nargs="?", default=str(CHART))
    parser.add_argument("-f", "--values", action="append", default=[], metavar="FILE")
    parser.add_argument("--name", default="cacheroute", help="release name")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--validate", action="store_true",
                        help="check every object against the Kubernetes schemas (offline)")
    parser.add_argument("--kube-version", action="append", default=None, metavar="X.Y.Z",
                        help=f"Kubernetes versions to validate against (default {', '.join(KUBE_VERSIONS)})")
    parser.add_argument("--lint", action="store_true", help="also run helm lint --strict")
    args = parser.parse_args(argv)

    import helm_python as helm

    values = load_values(args.values)
    try:
        rendered = render(values, chart=Path(args.chart), name=args.name, namespace=args.namespace)
    except helm.HelmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    objects = manifests(rendered)
    if not (args.validate or args.lint):
        print(yaml.safe_dump_all(objects, sort_keys=False), end="")
        return 0
    failed = False
    if args.validate:
        errors, unchecked = validate(objects, args.kube_version or KUBE_VERSIONS)
        for error in errors:
            print(f"invalid: {error}", file=sys.stderr)
        print(f"{len(objects)} objects, {len(errors)} schema errors; "
              f"no schema for: {', '.join(unchecked) or 'none'}")
        failed = failed or bool(errors)
    if args.lint:
        findings = lint(values, chart=Path(args.chart))
        for f in findings:
            print(f"lint: {f}", file=sys.stderr)
        print(f"helm lint --strict: {len(findings)} findings")
        failed = failed or bool(findings)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
