"""Our kustomize subset renders like kubectl kustomize, and refuses what it does not support."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scripts.deploy_check import KUSTOMIZATIONS
from scripts.deploy_check.__main__ import _kubectl_render, _normalized
from scripts.deploy_check.kustomize import KustomizeError, render, strategic_merge


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_every_kustomization_renders(directory: Path) -> None:
    objs = render(directory)
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "PodMonitor"} <= kinds


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: d.name)
def test_renderer_agrees_with_kubectl_kustomize(directory: Path) -> None:
    theirs = _kubectl_render(directory)
    assert not isinstance(theirs, str), theirs
    assert _normalized(render(directory)) == _normalized(theirs)


def test_overlays_set_namespace_replicas_and_image() -> None:
    prod = render(KUSTOMIZATIONS[2])
    sts = next(o for o in prod if o["kind"] == "StatefulSet")
    assert {o["metadata"]["namespace"] for o in prod} == {"llm-serving"}
    assert sts["spec"]["replicas"] == 8
    image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example.internal/llm/decode-worker:0.1.0"


def test_strategic_merge_merges_by_key_and_deletes_null() -> None:
    base = {"spec": {"containers": [{"name": "a", "resources": {"limits": {"x": 1, "y": 2}}},
                                    {"name": "b"}],
                     "args": ["one"]}}
    patch = {"spec": {"containers": [{"name": "a", "resources": {"limits": {"y": None}}},
                                     {"name": "b", "$patch": "delete"}],
                      "args": ["two"]}}
    out = strategic_merge(base, patch)
    assert out == {"spec": {"containers": [{"name": "a", "resources": {"limits": {"x": 1}}}],
                            "args": ["two"]}}
    assert base["spec"]["containers"][1] == {"name": "b"}  # inputs untouched


def test_unsupported_kustomization_field_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(KustomizeError, match="commonLabels"):
        render(tmp_path)


def test_missing_resource_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [nothere.yaml]\n")
    with pytest.raises(KustomizeError, match="not found"):
        render(tmp_path)
