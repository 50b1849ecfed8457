"""Every file mplan reads, fuzzed: a mutated file loads as the same object or fails with one clear error.

Readers: plan JSON (`Plan.load`), cluster JSON (`ClusterSpec.from_json`, with an inline profile and
with a profile path), profile JSON (`ClusterProfile.from_json`), a checkpoint's manifest `mplan.json`
(`read_manifest`, without a plan as a converted checkpoint's, and with one) and its DCP metadata
`dcp.json` (`read_dcp_metadata`, whose loads round-trip through `JsonMetadataWriter`), and model
specs (`resolve_model`: presets, `family:k=v,...`, a Hugging Face config.json path,
`package.module:factory`).

Mutations of a valid seed file: drop a key or a list item at any depth, replace a value by one of
another type or out of range (null, bools, strings, lists, objects, negative, zero, huge ints with
more digits than Python parses, NaN/Infinity, 100 000-deep nesting), add an unknown key, truncate
the text, splice in bytes that are not UTF-8. The property: the reader either returns an object
(which then round-trips through its own writer, and equals the seed's when the mutation changed
nothing) or raises the reader's documented error class whose message names the file and the field
(a key of the mutated path); any other exception fails the test with its traceback.

Besides the random mutations (hypothesis), `sweep` tries every single mutation exhaustively: each
field and object of the plan, cluster, profile, mplan.json and dcp.json seeds set to each of
`SWEEP_VALUES`, dropped, and (objects) given an unknown key.

Deterministic (`derandomize=True`); the cases tried per reader are counted in `CASES` and checked
by the last test (`pytest -s` prints them).
"""
from __future__ import annotations

import collections
import copy
import json
import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mplan
from mplan.cost_models.alpha_beta import AlphaBetaFit
from mplan.cost_models.cluster import ClusterSpec, ClusterSpecError
from mplan.json_fields import HugeNumber
from mplan.cost_models.profile import (
    AttentionTiming,
    ClusterProfile,
    CollectiveTiming,
    CopyTiming,
    DeviceProfile,
    GemmTiming,
    LinkProfile,
    ProfileError,
)
from mplan.models.spec import resolve_model
from mplan.planner.plan import Plan, PlanError
from mplan.runtime.checkpoint import CheckpointError, read_manifest
from mplan.runtime.checkpoint_storage import JsonMetadataWriter, read_dcp_metadata

CASES: collections.Counter[str] = collections.Counter()
"""reader -> cases tried (one per hypothesis example)"""
OUTCOMES: collections.Counter[tuple[str, str]] = collections.Counter()
"""(reader, "loaded" | "rejected") -> cases"""

EXAMPLES = {"plan": 300, "cluster": 300, "cluster+profile-path": 150, "profile": 300, "checkpoint": 250,
            "checkpoint+plan": 100, "dcp-metadata": 250,
            "hf-config": 80, "model-spec": 600}

HUGE = "@@HUGE@@"  # serialized as 5000 digits: more than Python's int() parses by default
DEEP = "@@DEEP@@"  # serialized as 100 000 nested arrays: deeper than the parser recurses
RAW = {json.dumps(HUGE): "9" * 5000, json.dumps(DEEP): "[" * 100_000 + "]" * 100_000}

ODD_VALUES = [None, True, False, 0, -1, 1, 2, 3, 7, 10**30, 10**400, -(10**400), 0.5, -0.5, 1e308, -0.0,
              math.nan, math.inf, -math.inf, "", "x", "S(0)", "none", "0", "../x", "a\x00b", [], [1], ["a"], [{}],
              {}, {"a": 1}, HUGE, DEEP]
VALUES = st.one_of(st.sampled_from(ODD_VALUES), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
KEYS = st.one_of(st.sampled_from(["extra", "", "version", "name", "Version", "profile "]), st.text(max_size=8))


def _paths(tree, prefix=()):
    """Every (path, value) in a JSON tree, the root first."""
    yield prefix, tree
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, (*prefix, i))


def _parent(tree, path):
    for step in path[:-1]:
        tree = tree[step]
    return tree


def mutations(seed):
    """A strategy of lists of mutations of the JSON tree `seed` (each valid for the seed's paths)."""
    paths = [p for p, _ in _paths(seed)]
    inner = [p for p in paths if p]
    dicts = [p for p, v in _paths(seed) if isinstance(v, dict)]
    tree_ops = st.one_of(
        st.tuples(st.just("drop"), st.sampled_from(inner)),
        st.tuples(st.just("set"), st.sampled_from(paths), VALUES),
        st.tuples(st.just("add"), st.sampled_from(dicts), KEYS, VALUES),
    )
    text_ops = st.one_of(
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("bytes"), st.floats(0, 1), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00",
                                                                      b"\xef\xbb\xbf", b"}", b",", b'"'])),
    )
    return st.one_of(st.lists(tree_ops, min_size=1, max_size=3), st.lists(text_ops, min_size=1, max_size=1))


def apply(seed, ops):
    """(mutated bytes, mutated tree or None for a text mutation, string keys the mutations touched)."""
    tree = copy.deepcopy(seed)
    touched: list[str] = []
    text_ops = []
    for op in ops:
        kind = op[0]
        if kind in ("truncate", "bytes"):
            text_ops.append(op)
            continue
        path = op[1]
        try:
            parent = _parent(tree, path) if path else None
            if kind == "drop":
                del parent[path[-1]]
            elif kind == "set" and not path:
                tree = op[2]
                touched.clear()  # the earlier mutations went with the old root
            elif kind == "set":
                parent[path[-1]] = op[2]
            else:
                target = _parent(tree, (*path, None))
                if not isinstance(target, dict):
                    continue
                target[op[2]] = op[3]
                touched.append(op[2])
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or retyped this path
        touched.extend(str(step) for step in path if isinstance(step, str))
    text = json.dumps(tree, indent=1)
    for token, raw in RAW.items():
        text = text.replace(token, raw)
    data = text.encode() + b"\n"
    for op in text_ops:
        at = int(op[1] * len(data))
        data = data[:at] if op[0] == "truncate" else data[:at] + op[2] + data[at:]
    return data, (tree if not text_ops else None), touched


def _same_json(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


RELATED = {"dcp-metadata": {"offset": ("storage entry",), "chunks": ("storage entry",)}}
"""Per reader, a field whose wrong value an error may report under the field it disagrees with
(dcp.json: a storage entry moved to other offsets, or a chunk moved, leaves `chunk [..] of T has no
storage entry`)."""


def check(reader, load, error, seed, seed_object, ops, file, roundtrip):
    """Write the mutated file, load it; assert the property of the module docstring."""
    data, tree, touched = apply(seed, ops)
    with open(file, "wb") as handle:
        handle.write(data)
    CASES[reader] += 1
    try:
        loaded = load(file)
    except error as exc:
        OUTCOMES[reader, "rejected"] += 1
        message = str(exc)
        assert "Traceback" not in message
        assert file in message, f"{reader}: the error does not name the file: {message}"
        if tree is None:  # text mutation: the file is no longer JSON, or a byte landed in a string
            return
        if "nested too deeply" in message and any(DEEP in op for op in ops):
            return  # the parser gave up before any field was read
        if touched:
            touched += [other for key in touched for other in RELATED.get(reader, {}).get(key, ())]
            assert any(key in message for key in touched), \
                f"{reader}: {ops!r}: the error names none of {touched}: {message}"
        else:
            assert "top level" in message or "must be" in message or "is missing" in message, message
        return
    OUTCOMES[reader, "loaded"] += 1
    assert roundtrip(loaded) == loaded, f"{reader}: {ops!r} loaded an object that does not round-trip"
    if (tree is not None and _same_json(tree, seed)) or (tree is None and data.strip() == _seed_bytes(seed).strip()):
        assert loaded == seed_object, f"{reader}: {ops!r} changed nothing but loaded another object"


def _via_json(doc):
    """What the writer's dict becomes in a file (tuples turn into arrays)."""
    return json.loads(json.dumps(doc))


def _seed_bytes(seed) -> bytes:
    return json.dumps(seed, indent=1).encode()


SWEEP_VALUES = [None, True, "x", -1, 0, 0.5, 10**400, HugeNumber("9" * 5000), math.nan, math.inf, [], {}]
"""Every leaf and every object of a seed is set to each of these in turn, dropped, and given an extra key."""


def sweep(reader, seed, load_tree, error, seed_object, roundtrip) -> int:
    """Exhaustive single mutations of `seed` in memory (in place, undone after each); returns the count."""
    tried = 0

    def one(tree, touched, what):
        nonlocal tried
        tried += 1
        CASES[reader + " (sweep)"] += 1
        try:
            loaded = load_tree(tree)
        except error as exc:
            message = str(exc)
            names = touched + [other for key in touched for other in RELATED.get(reader, {}).get(key, ())]
            assert not names or any(key in message for key in names), \
                f"{reader}: {what}: the error names none of {names}: {message}"
            return
        assert roundtrip(loaded) == loaded, f"{reader}: {what} loaded an object that does not round-trip"

    for path, value in list(_paths(seed)):
        if not path:
            continue
        parent, key = _parent(seed, path), path[-1]
        touched = [str(step) for step in path if isinstance(step, str)]
        for odd in SWEEP_VALUES:
            parent[key] = odd
            try:
                one(seed, touched, f"{path} = {odd!r}")
            finally:
                parent[key] = value
        if isinstance(parent, dict):
            del parent[key]
            try:
                one(seed, touched, f"drop {path}")
            finally:
                parent[key] = value
        else:
            parent.pop(key)
            try:
                one(seed, touched, f"drop {path}")
            finally:
                parent.insert(key, value)
        if isinstance(value, dict):
            value["extra field"] = 1
            try:
                one(seed, touched + ["extra field"], f"add a key at {path}")
            finally:
                del value["extra field"]
    return tried


FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                      HealthCheck.large_base_example])


# -- seeds ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="mplan-fuzz-") as directory:
        yield directory


def _small_profile() -> ClusterProfile:
    device = DeviceProfile(
        name="NVIDIA H200", torch_version="2.9.0", measured_on="2026-11-29",
        gemm=(GemmTiming(m=1024, n=1024, k=1024, dtype="bf16", seconds=3.1e-6),
              GemmTiming(m=4096, n=4096, k=4096, dtype="fp32", seconds=2.5e-3)),
        attention=(AttentionTiming(batch=1, heads=8, seq_q=1024, seq_kv=1024, head_dim=64, dtype="bf16", causal=True,
                                   forward_s=3.2e-5, forward_backward_s=1.6e-4),),
        copy=(CopyTiming(bytes_moved=1 << 20, seconds=2e-6), CopyTiming(bytes_moved=1 << 30, seconds=4e-4)))
    links = LinkProfile(
        backend="nccl", world_size=8, ranks_per_node=8, measured_on="2026-11-29",
        timings=(CollectiveTiming(collective="all_reduce", level="intra_node", group_size=8, ranks_per_node=8,
                                  nbytes=1 << 20, seconds=2e-5),),
        fits=(AlphaBetaFit(collective="all_reduce", level="intra_node", alpha_s=1e-5, beta_Bps=3e11, group_size=8,
                           num_points=6, max_rel_error=0.05),
              AlphaBetaFit(collective="all_gather", level="inter_node", alpha_s=2e-5, beta_Bps=4e10, group_size=2,
                           num_points=6, max_rel_error=0.1, min_bus_bytes=65536.0)))
    return ClusterProfile(note="fuzz seed", device=device, links=links)


@pytest.fixture(scope="module")
def plan_seed():
    plan = mplan.plan("tiny-llama", cluster=ClusterSpec.preset("dgx-h100"), global_batch=16)
    return json.loads(plan.to_json()), plan


@pytest.fixture(scope="module")
def profile_seed():
    profile = _small_profile()
    return profile.to_dict(), profile


@pytest.fixture(scope="module")
def cluster_seed():
    cluster = ClusterSpec.preset("dgx-h100", nodes=2).with_profile(_small_profile())
    return cluster.to_dict(), cluster


# -- the file readers ----------------------------------------------------------------------------

READERS = {
    # name: (seed fixture, loader, its error, the reload a loaded object must survive)
    "plan": ("plan_seed", Plan.load, PlanError, lambda p: Plan.from_dict(_via_json(p.to_dict()))),
    "cluster": ("cluster_seed", ClusterSpec.from_json, ClusterSpecError,
                lambda c: ClusterSpec.from_dict(_via_json(c.to_dict()))),
    "profile": ("profile_seed", ClusterProfile.from_json, ProfileError,
                lambda p: ClusterProfile.from_dict(_via_json(p.to_dict()))),
}


@pytest.mark.parametrize("name", list(READERS))
def test_fuzz_file(name, request, workdir):
    fixture, load, error, reload = READERS[name]
    seed, loaded = request.getfixturevalue(fixture)
    if name == "plan":
        assert Plan.from_dict(seed) == loaded
    file = os.path.join(workdir, f"{name}.json")

    @settings(max_examples=EXAMPLES[name], **FUZZ)
    @given(mutations(seed))
    def fuzz(ops):
        check(name, load, error, seed, loaded, ops, file, reload)

    fuzz()


def test_fuzz_cluster_file_with_profile_path(cluster_seed, profile_seed, workdir):
    """A cluster whose `profile` is a path to a profile file, relative to the cluster file."""
    seed = {**cluster_seed[0], "profile": "profile-for-cluster.json"}
    profile_seed[1].to_json(os.path.join(workdir, "profile-for-cluster.json"))
    cluster = cluster_seed[1]
    file = os.path.join(workdir, "cluster-path.json")

    profile_values = st.one_of(VALUES, st.sampled_from(
        ["nosuch.json", ".", "/", "", "cluster-path.json", "profile.json", "a\x00b", "../profile-for-cluster.json",
         os.path.join(workdir, "profile-for-cluster.json"), "profile-for-cluster.json/"]))

    @settings(max_examples=EXAMPLES["cluster+profile-path"], **FUZZ)
    @given(st.one_of(mutations(seed), st.lists(st.tuples(st.just("set"), st.just(("profile",)), profile_values),
                                                min_size=1, max_size=1)))
    def fuzz(ops):
        check("cluster+profile-path", ClusterSpec.from_json, ClusterSpecError, seed, cluster, ops, file,
              lambda c: ClusterSpec.from_dict(_via_json(c.to_dict())))

    fuzz()




CHECKPOINT_SEED = {
    "format": "mplan.checkpoint", "version": 2, "step": 6, "world_size": 2, "saved_at": "2026-12-05T12:00:00+00:00",
    "model": {"name": "GPTModel", "params": {
        "embed.weight": {"shape": [64, 32], "aliases": ["lm_head.weight"]},
        "layers.0.attn.q_proj.bias": {"shape": [32], "aliases": []},
        "norm.weight": {"shape": [32], "aliases": []}}},
    "optimizer": {"class": "AdamW", "param_groups": [
        {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False}]},
    "extras": {"lr_schedule": {"last_epoch": 6, "base_lrs": [0.01]}},
    "hf_config": {"architectures": ["GPT2LMHeadModel"], "n_embd": 32, "n_layer": 1}}
"""An mplan.json as `save_checkpoint` writes it, less the plan (a converted checkpoint has none);
`_with_plan` adds the plan of `plan_seed`."""

DCP_SEED = {
    "format": "mplan.dcp-metadata",
    "tensors": {
        "model/embed.weight": {"dtype": "float64", "size": [64, 32],
                               "chunks": [[[0, 0], [32, 32]], [[32, 0], [32, 32]]]},
        "optim/embed.weight/exp_avg": {"dtype": "float32", "size": [64, 32], "chunks": [[[0, 0], [64, 32]]]},
        "optim/embed.weight/step": {"dtype": "float32", "size": [], "chunks": [[[], []]]},
        "rng/rank0/cpu": {"dtype": "uint8", "size": [5056], "chunks": [[[0], [5056]]]}},
    "storage": [
        {"fqn": "model/embed.weight", "offset": [0, 0], "file": "__0_0.distcp", "start": 0, "length": 9769,
         "crc32": 2206214473},
        {"fqn": "model/embed.weight", "offset": [32, 0], "file": "__1_0.distcp", "start": 0, "length": 9769,
         "crc32": 93840211},
        {"fqn": "optim/embed.weight/exp_avg", "offset": [0, 0], "file": "__0_0.distcp", "start": 9769, "length": 9769,
         "crc32": 3910256634},
        {"fqn": "optim/embed.weight/step", "offset": [], "file": "__0_0.distcp", "start": 19538, "length": 1100,
         "crc32": 0},
        {"fqn": "rng/rank0/cpu", "offset": [0], "file": "__0_0.distcp", "start": 20638, "length": 6500,
         "crc32": 4294967295}]}
"""A dcp.json as `JsonMetadataWriter` writes it: a TP-sharded parameter (two chunks, one per rank's
file), a whole optimizer state, a scalar (`step`) and a random generator's state."""


def _with_plan(plan_seed) -> dict:
    return {**copy.deepcopy(CHECKPOINT_SEED), "plan": copy.deepcopy(plan_seed[0])}


def _dcp_roundtrip(metadata):
    """Write the loaded metadata with mplan's writer, read it back."""
    from torch.distributed.checkpoint.storage import WriteResult

    with tempfile.TemporaryDirectory(prefix="mplan-dcp-") as directory:
        results = [[WriteResult(index=index, size_in_bytes=info.length, storage_data=info)
                    for index, info in metadata.storage_data.items()]]
        JsonMetadataWriter(directory).finish(metadata, results)
        return read_dcp_metadata(directory)


def _fuzz_checkpoint_file(reader, seed, file, load, roundtrip):
    with open(file, "w") as handle:
        json.dump(seed, handle)
    expected = load(file)

    @settings(max_examples=EXAMPLES[reader], **FUZZ)
    @given(mutations(seed))
    def fuzz(ops):
        check(reader, load, CheckpointError, seed, expected, ops, file, roundtrip)

    fuzz()


@pytest.mark.parametrize("reader", ["checkpoint", "checkpoint+plan"])
def test_fuzz_checkpoint_manifest(reader, request, workdir):
    seed = CHECKPOINT_SEED if reader == "checkpoint" else _with_plan(request.getfixturevalue("plan_seed"))
    directory = os.path.join(workdir, reader)
    os.makedirs(directory, exist_ok=True)
    _fuzz_checkpoint_file(reader, seed, os.path.join(directory, "mplan.json"), lambda _: read_manifest(directory),
                          lambda doc: doc)


def test_fuzz_dcp_metadata(workdir):
    directory = os.path.join(workdir, "dcp")
    os.makedirs(directory, exist_ok=True)
    _fuzz_checkpoint_file("dcp-metadata", DCP_SEED, os.path.join(directory, "dcp.json"),
                          lambda _: read_dcp_metadata(directory), _dcp_roundtrip)


# -- exhaustive single mutations -----------------------------------------------------------------

def test_sweep_plan(plan_seed):
    seed, plan = copy.deepcopy(plan_seed[0]), plan_seed[1]
    assert sweep("plan", seed, lambda tree: Plan.from_dict(tree, file="plan.json"), PlanError, plan,
                 lambda p: Plan.from_dict(_via_json(p.to_dict()))) > 4000
    assert seed == plan_seed[0]


def test_sweep_cluster(cluster_seed):
    seed, cluster = copy.deepcopy(cluster_seed[0]), cluster_seed[1]
    assert sweep("cluster", seed, lambda tree: ClusterSpec.from_dict(tree, file="cluster.json"), ClusterSpecError,
                 cluster, lambda c: ClusterSpec.from_dict(_via_json(c.to_dict()))) > 800


def test_sweep_profile(profile_seed):
    seed, profile = copy.deepcopy(profile_seed[0]), profile_seed[1]
    assert sweep("profile", seed, lambda tree: ClusterProfile.from_dict(tree, file="profile.json"), ProfileError,
                 profile, lambda p: ClusterProfile.from_dict(_via_json(p.to_dict()))) > 700


def _checkpoint_loader(directory, name, read):
    """Write a (mutated) seed tree as `directory/name` and read it back."""
    def load(tree):
        text = json.dumps(tree, default=lambda huge: HUGE)
        for token, raw in RAW.items():
            text = text.replace(token, raw)
        with open(os.path.join(directory, name), "w") as handle:
            handle.write(text)
        return read(directory)
    return load


def test_sweep_checkpoint_manifest(workdir, plan_seed):
    directory = os.path.join(workdir, "checkpoint-sweep")
    os.makedirs(directory, exist_ok=True)
    load = _checkpoint_loader(directory, "mplan.json", read_manifest)
    assert sweep("checkpoint", copy.deepcopy(CHECKPOINT_SEED), load, CheckpointError, None, lambda doc: doc) > 550
    # the plan's own fields are swept by test_sweep_plan; here the plan as a whole, in its place
    seed = _with_plan(plan_seed)
    assert load(seed).plan == plan_seed[1]
    for odd in SWEEP_VALUES:
        CASES["checkpoint (sweep)"] += 1
        try:
            loaded = load({**seed, "plan": odd})
        except CheckpointError as exc:
            assert "mplan.json: plan" in str(exc), str(exc)
            continue
        assert odd is None and loaded.plan is None, f"plan = {odd!r} loaded"


def test_sweep_dcp_metadata(workdir):
    directory = os.path.join(workdir, "dcp-sweep")
    os.makedirs(directory, exist_ok=True)
    load = _checkpoint_loader(directory, "dcp.json", read_dcp_metadata)
    assert sweep("dcp-metadata", copy.deepcopy(DCP_SEED), load, CheckpointError, None, _dcp_roundtrip) > 1200


# -- model specs ---------------------------------------------------------------------------------

def _hf_seed() -> dict:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return json.loads(config.to_json_string())


def test_fuzz_hf_config_path(workdir):
    seed = _hf_seed()
    directory = os.path.join(workdir, "hf-model")
    os.makedirs(directory, exist_ok=True)
    file = os.path.join(directory, "config.json")
    with open(file, "w") as handle:
        json.dump(seed, handle)
    source = resolve_model(file)
    expected = (source.family, source.name, source.seq_len, source.vocab)

    def load(path):
        got = resolve_model(path)
        return got.family, got.name, got.seq_len, got.vocab

    @settings(max_examples=EXAMPLES["hf-config"], **FUZZ)
    @given(mutations(seed))
    def fuzz(ops):
        data, tree, _ = apply(seed, ops)
        with open(file, "wb") as handle:
            handle.write(data)
        CASES["hf-config"] += 1
        try:
            got = load(file)
        except ValueError as exc:
            OUTCOMES["hf-config", "rejected"] += 1
            assert file in str(exc), str(exc)
            return
        OUTCOMES["hf-config", "loaded"] += 1
        family, name, seq_len, vocab = got
        assert family == "hf" and name == "hf-model"
        assert seq_len is None or (type(seq_len) is int and seq_len > 0), seq_len
        assert vocab is None or (type(vocab) is int and vocab > 0), vocab
        if tree is not None and _same_json(tree, seed):
            assert got == expected

    fuzz()


SPEC_KEYS = ["layers", "hidden", "heads", "seq", "vocab", "ffn", "tie", "eps", "kv_heads", "theta", "experts",
             "topk", "capacity", "aux", "shared", "bogus", "", "Layers", "layers "]
SPEC_VALUES = st.one_of(
    st.sampled_from(["1", "2", "4", "8", "64", "0", "-1", "1.5", "nan", "inf", "-inf", "1e400", "9" * 5000, "none",
                     "true", "0x10", "1_000", " 4", "", "=", "abc", "1e-5", "2.0"]),
    st.integers(-5, 10**6).map(str), st.text(max_size=6))
FAMILY_SPECS = st.builds(
    lambda family, items: f"{family}:" + ",".join(items),
    st.sampled_from(["gpt", "llama", "moe"]),
    st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(SPEC_KEYS), SPEC_VALUES),
                       st.sampled_from(["layers", "=", ",", "layers==2"])), max_size=9))
VALID_FAMILY_SPECS = [
    "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=128",
    "llama:layers=2,hidden=64,heads=4,seq=32,vocab=128,ffn=172,kv_heads=2",
    "moe:layers=2,hidden=64,heads=4,seq=32,vocab=128,ffn=128,experts=4,topk=2,capacity=1.25",
]


def _edit_spec(spec: str, cut: float, insert: str) -> str:
    at = int(cut * len(spec))
    return spec[:at] + insert + spec[at:]


def _override(spec: str, changes: list[tuple[str, str]]) -> str:
    """A valid family spec with some keys set to other values (or added)."""
    family, _, body = spec.partition(":")
    items = dict(item.split("=") for item in body.split(","))
    items.update(changes)
    return f"{family}:" + ",".join(f"{k}={v}" for k, v in items.items())


OVERRIDDEN_SPECS = st.builds(_override, st.sampled_from(VALID_FAMILY_SPECS),
                             st.lists(st.tuples(st.sampled_from(SPEC_KEYS), SPEC_VALUES), min_size=1, max_size=2))

MODEL_SPECS = st.one_of(
    FAMILY_SPECS,
    OVERRIDDEN_SPECS,
    OVERRIDDEN_SPECS,
    st.builds(_edit_spec, st.sampled_from(VALID_FAMILY_SPECS), st.floats(0, 1),
              st.sampled_from(["", ",", "=", "0", "-", "x", ",bogus=1", ",layers=3", "\x00", ":"])),
    st.builds(lambda s, cut: s[:int(cut * len(s))], st.sampled_from(VALID_FAMILY_SPECS), st.floats(0, 1)),
    st.sampled_from(["tiny-llama", "gpt3-175b", "llama3-8b", " tiny-llama ", "TINY-LLAMA", "", " ", ":", "gpt:",
                     "nosuch", "nosuch.json", "/nonexistent/config.json", ".", "tests", "a\x00b", "gpt:layers=2:x"]),
    # factories, from modules safe to import: missing modules and attributes, non-callables, callables that
    # need arguments, return the wrong thing, or raise
    st.builds(lambda module, attribute: f"{module}:{attribute}",
              st.sampled_from(["math", "json", "collections", "os.path", "mplan.models.presets",
                               "mplan.models.config", "nosuch_module_xyz", "mplan.nosuch"]),
              st.sampled_from(["sqrt", "pi", "dumps", "OrderedDict", "join", "PRESETS", "GPTConfig", "nosuch",
                               "getcwd", "LlamaConfig"])),
    st.text(max_size=20),
)


def test_fuzz_model_spec():
    @settings(max_examples=EXAMPLES["model-spec"], **FUZZ)
    @given(MODEL_SPECS)
    def fuzz(spec):
        CASES["model-spec"] += 1
        try:
            source = resolve_model(spec)
        except ValueError as exc:
            OUTCOMES["model-spec", "rejected"] += 1
            message = str(exc)
            assert message and "Traceback" not in message
            family, sep, rest = spec.strip().partition(":")
            if sep and family in ("gpt", "llama", "moe"):
                assert "model spec" in message, message
            return
        OUTCOMES["model-spec", "loaded"] += 1
        if source.family in ("gpt", "llama", "moe"):
            config = source.config
            for name in ("num_layers", "hidden", "num_heads", "seq_len", "vocab"):
                assert type(getattr(config, name)) is int and getattr(config, name) > 0
            assert math.isfinite(config.norm_eps) and config.norm_eps > 0
            assert config.num_parameters() > 0

    fuzz()


def test_zz_cases_counted():
    """The totals (run with -s to see them); every reader ran its examples when the whole file ran."""
    print("\nfuzz cases tried per reader:")
    for reader in EXAMPLES:
        print(f"  {reader:22s} {CASES[reader]:5d}  (loaded {OUTCOMES[reader, 'loaded']}, "
              f"rejected {OUTCOMES[reader, 'rejected']})")
    for reader in sorted(key for key in CASES if key.endswith("(sweep)")):
        print(f"  {reader:22s} {CASES[reader]:5d}")
    print(f"  {'total':22s} {sum(CASES.values()):5d}")
    ran = [reader for reader in EXAMPLES if CASES[reader]]
    for reader in ran:
        assert CASES[reader] >= EXAMPLES[reader], (reader, CASES[reader])
