#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests in deploy/: each kustomization renders
(`kubectl kustomize`), every built-in kind passes `kubernetes-validate --strict` against
Kubernetes' own schemas, and every InferencePool passes the vendored CRD's OpenAPI schema
(deploy/crds/) and the two CEL rules that schema states. Run from a venv with
scripts/deploy-requirements.txt.

    python scripts/validate_deploy.py
"""

import glob
import os
import subprocess
import sys
import tempfile

import jsonschema
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAYS = ["deploy/base", "deploy/llm-d", "deploy/dynamo"]


def crd_schemas():
    """(apiVersion, kind) -> the openAPIV3Schema of each vendored CRD version."""
    schemas = {}
    for path in glob.glob(os.path.join(REPO, "deploy", "crds", "*.yaml")):
        crd = yaml.safe_load(open(path))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            schemas[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return schemas


def structural(schema):
    """The CRD schema as JSON Schema, strict as `kubectl apply --validate=strict`: an object
    with listed properties takes no others. Kubernetes' x- extensions are dropped (the CEL
    rules are checked by `cel_rules`)."""
    if isinstance(schema, dict):
        out = {k: structural(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [structural(v) for v in schema]
    return schema


def cel_rules(pool):
    """The InferencePool CRD's x-kubernetes-validations, by hand."""
    spec = pool["spec"]
    ref = spec.get("endpointPickerRef", {})
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        yield "endpointPickerRef: port is required when kind is 'Service' or unspecified"
    numbers = [p["number"] for p in spec.get("targetPorts", [])]
    if len(numbers) != len(set(numbers)):
        yield "targetPorts: port number must be unique"


# API groups kubernetes-validate has Kubernetes' own schemas for; any other group needs a
# vendored CRD, or the object fails.
BUILTIN_GROUPS = {"", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io",
                  "storage.k8s.io", "scheduling.k8s.io"}


def group(doc):
    return doc["apiVersion"].rsplit("/", 1)[0] if "/" in doc["apiVersion"] else ""


def check(docs, schemas):
    """Every problem with these objects, as messages."""
    problems = []
    builtin = [d for d in docs if group(d) in BUILTIN_GROUPS]
    for d in docs:
        if group(d) not in BUILTIN_GROUPS and (d["apiVersion"], d["kind"]) not in schemas:
            problems.append(f"{d['kind']} {d['apiVersion']}: no vendored schema")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump_all(builtin, f)
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", f.name],
                       capture_output=True, text=True)
    os.unlink(f.name)
    if r.returncode != 0:
        problems.append(f"kubernetes-validate: {r.stdout}{r.stderr}".strip())
    for d in docs:
        if (d["apiVersion"], d["kind"]) in schemas:
            schema = structural(schemas[(d["apiVersion"], d["kind"])])
            problems += [f"{d['kind']} {d['metadata']['name']}: {e.message}"
                         for e in jsonschema.Draft7Validator(schema).iter_errors(d)]
            if d["kind"] == "InferencePool":
                problems += [f"InferencePool {d['metadata']['name']}: {e}" for e in cel_rules(d)]
    return problems


def broken(docs):
    """Copies of `docs` each with one mistake the checks must catch."""
    import copy
    for kind, mistake in [
        ("Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0].update(imagePullPolcy="Always")),
        ("InferencePool", lambda d: d["spec"]["endpointPickerRef"].pop("port")),
        ("InferencePool", lambda d: d["spec"].update(targetPorts=[{"number": 8000}, {"number": 8000}])),
        ("InferencePool", lambda d: d["spec"].update(replicas=2)),
    ]:
        if any(d["kind"] == kind for d in docs):
            mutated = copy.deepcopy(docs)
            mistake(next(d for d in mutated if d["kind"] == kind))
            yield kind, mutated


def main():
    schemas = crd_schemas()
    failures = 0
    for overlay in OVERLAYS:
        rendered = subprocess.run(["kubectl", "kustomize", os.path.join(REPO, overlay)], check=True,
                                  capture_output=True, text=True).stdout
        docs = [d for d in yaml.safe_load_all(rendered) if d]
        problems = check(docs, schemas)
        for p in problems:
            print(f"FAIL {overlay}: {p}")
        failures += len(problems)
        # The checks are not vacuous: each planted mistake is caught.
        for kind, mutated in broken(docs):
            if not check(mutated, schemas):
                print(f"FAIL {overlay}: a planted mistake in the {kind} passed")
                failures += 1
        custom = sum((d["apiVersion"], d["kind"]) in schemas for d in docs)
        kinds = ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        print(f"DEPLOY {overlay}: {len(docs)} objects ({kinds}), {custom} checked against a vendored CRD")
    print(f"DEPLOY {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
