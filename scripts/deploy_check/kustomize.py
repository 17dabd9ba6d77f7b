"""A small kustomize renderer: the subset our manifests use, and an error for anything else.

Used where no `kubectl kustomize` is installed; `check_deploy.sh` renders with kubectl when it can
and tests/deploy compares the two. Supported kustomization fields: `resources` (files and
directories), `namespace`, `images`, `replicas`, `patches` (strategic-merge patch files, matched by
kind and name). Strategic merge follows Kubernetes' rules for the lists we patch (containers,
env, volumes, volume mounts and ports merge by their key; other lists are replaced) and deletes
a map key whose patch value is null.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PriorityClass", "StorageClass", "PersistentVolume",
}
# list field -> merge key candidates (first one present in the items wins).
MERGE_KEYS = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "envFrom": (),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),
    "imagePullSecrets": ("name",),
}


class KustomizeError(ValueError):
    """The kustomization uses something this renderer does not support, or refers to nothing."""


def load_docs(path: Path) -> list[Obj]:
    """All non-empty YAML documents of one file."""
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def render(directory: Path) -> list[Obj]:
    """Render one kustomization directory to its list of objects (like `kubectl kustomize`)."""
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported fields {sorted(unknown)}")
    objs: list[Obj] = []
    for res in spec.get("resources", []):
        path = directory / res
        if path.is_dir():
            objs.extend(render(path))
        elif path.is_file():
            objs.extend(load_docs(path))
        else:
            raise KustomizeError(f"{kfile}: resource {res} not found")
    for patch in spec.get("patches", []):
        _apply_patch_entry(directory, kfile, patch, objs)
    for rep in spec.get("replicas", []):
        _set_replicas(kfile, objs, rep["name"], int(rep["count"]))
    for image in spec.get("images", []):
        _set_image(objs, image)
    if "namespace" in spec:
        for obj in objs:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return objs


def _apply_patch_entry(directory: Path, kfile: Path, entry: Obj, objs: list[Obj]) -> None:
    if set(entry) - {"path"}:
        raise KustomizeError(f"{kfile}: only `patches: - path: FILE` is supported, got {entry}")
    for doc in load_docs(directory / entry["path"]):
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        target = [o for o in objs if o.get("kind") == kind and o["metadata"].get("name") == name]
        if len(target) != 1:
            raise KustomizeError(f"{kfile}: patch {entry['path']} matches {len(target)} objects")
        merged = strategic_merge(target[0], doc)
        target[0].clear()
        target[0].update(merged)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Return `base` with `patch` merged in (inputs are not modified)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and MERGE_KEYS.get(field):
        return _merge_list(base, patch, MERGE_KEYS[field])
    return copy.deepcopy(patch)


def _merge_list(base: list[Any], patch: list[Any], keys: tuple[str, ...]) -> list[Any]:
    out = copy.deepcopy(base)
    for item in patch:
        key = next((k for k in keys if isinstance(item, dict) and k in item), None)
        if key is None:
            raise KustomizeError(f"list item {item!r} has none of the merge keys {keys}")
        index = next((i for i, b in enumerate(out) if b.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
        elif index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = strategic_merge(out[index], item)
    return out


def _set_replicas(kfile: Path, objs: list[Obj], name: str, count: int) -> None:
    hits = [o for o in objs if o.get("kind") in ("Deployment", "StatefulSet", "ReplicaSet")
            and o["metadata"].get("name") == name]
    if not hits:
        raise KustomizeError(f"{kfile}: replicas for {name}: no such workload")
    for obj in hits:
        obj.setdefault("spec", {})["replicas"] = count


def _set_image(objs: list[Obj], image: Obj) -> None:
    for obj in objs:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, tag = _split_image(container.get("image", ""))
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def _split_image(ref: str) -> tuple[str, str]:
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        return ref[: ref.rindex(":")], ref[ref.rindex(":") + 1 :]
    return ref, ""
