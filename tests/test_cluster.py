"""ClusterSpec: presets with their published figures, JSON round trips, one clear error per bad field."""
from __future__ import annotations

import ast
import json
import pathlib
import types

import pytest

from mplan.cost_models import presets
from mplan.cost_models.cluster import ClusterSpec, ClusterSpecError
from mplan.cost_models.profile import ClusterProfile, DeviceProfile, GemmTiming

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_dgx_a100_preset_carries_the_published_figures() -> None:
    spec = ClusterSpec.preset("dgx-a100", nodes=4, measured=False)
    assert (spec.num_nodes, spec.gpus_per_node, spec.world_size) == (4, 8, 32)
    assert spec.device.peak_flops("bf16") == 312e12
    assert spec.device.memory_bandwidth_Bps == 2.039e12
    assert spec.links.intra_node.bandwidth_Bps == 300e9
    assert spec.links.inter_node.kind == "infiniband"
    assert spec.links.inter_node.bandwidth_Bps * spec.gpus_per_node == 200e9  # 8 x HDR 200 Gb/s = 200 GB/s
    assert spec.links.intra_node.effective_bandwidth_Bps == pytest.approx(232.5e9)  # nccl-tests#175
    assert spec.links.inter_node.effective_bandwidth_Bps == pytest.approx(24e9)  # ~24 GB/s per HDR NIC
    with pytest.raises(ClusterSpecError, match="no fp8 peak"):
        spec.device.peak_flops("fp8")


def test_hopper_presets_use_dense_datasheet_peaks() -> None:
    h100 = ClusterSpec.preset("dgx-h100", measured=False)
    h200 = ClusterSpec.preset("dgx-h200", measured=False)
    assert h100.device.peak_bf16 == h200.device.peak_bf16 == 989.4e12  # not the 1,979 "with sparsity"
    assert h100.device.peak_fp8 == 1978.9e12
    assert (h100.device.memory_bandwidth_Bps, h200.device.memory_bandwidth_Bps) == (3.35e12, 4.8e12)
    assert h100.links.intra_node.bandwidth_Bps == 450e9 and h100.links.inter_node.bandwidth_Bps == 50e9


def test_h200_preset_is_the_measured_single_gpu() -> None:
    spec = ClusterSpec.preset("h200", measured=False)
    assert spec.world_size == 1
    assert spec.device.peak_bf16 == 788e12 and spec.device.memory_bandwidth_Bps == 4.25e12
    assert "measured here on 2026-11-29" in spec.device.source
    assert spec.device.gemm_efficiency == 1.0
    # The datasheet preset's efficiency makes the two agree on what a large GEMM achieves.
    dgx = ClusterSpec.preset("dgx-h200", measured=False).device
    assert dgx.peak_bf16 * dgx.gemm_efficiency == pytest.approx(788e12)


def test_cpu_preset_ranks_are_configurable_and_single_node() -> None:
    spec = ClusterSpec.preset("cpu", gpus_per_node=4)
    assert (spec.num_nodes, spec.world_size, spec.links.intra_node.kind) == (1, 4, "loopback")
    assert ClusterSpec.preset("cpu").world_size == 1
    with pytest.raises(ClusterSpecError, match="single node"):
        ClusterSpec.preset("cpu", nodes=2)


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.preset("dgx-b200")
    assert str(info.value) == "unknown cluster preset 'dgx-b200'; presets: dgx-a100, dgx-h100, dgx-h200, h200, cpu"


@pytest.mark.parametrize("name", list(presets.PRESETS))
def test_every_preset_round_trips_through_json(name: str, tmp_path: pathlib.Path) -> None:
    spec = ClusterSpec.preset(name, nodes=2 if name.startswith("dgx") else 1)
    path = tmp_path / "cluster.json"
    spec.to_json(str(path))
    assert ClusterSpec.from_json(str(path)) == spec


def _write(tmp_path: pathlib.Path, obj: object, name: str = "cluster.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def _spec_dict() -> dict:
    return ClusterSpec.preset("dgx-h100", nodes=2, measured=False).to_dict()


def test_a_wrong_field_gets_one_error_naming_it(tmp_path: pathlib.Path) -> None:
    obj = _spec_dict()
    obj["links"]["inter_node"]["bandwidth_Bps"] = "fast"
    path = _write(tmp_path, obj)
    with pytest.raises(ClusterSpecError) as info:
        ClusterSpec.from_json(path)
    assert str(info.value) == f'{path}: links.inter_node.bandwidth_Bps must be a positive number, got "fast"'


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.pop("gpus_per_node"), "gpus_per_node is missing"),
    (lambda o: o.update(num_nodes=0), "num_nodes must be an integer >= 1, got 0"),
    (lambda o: o.update(version=2), "version must be 1"),
    (lambda o: o.update(typo=1), "typo is not a known field"),
    (lambda o: o["device"]["peak_flops"].update(bf16=-1), "device.peak_flops.bf16 must be a positive number, got -1"),
    (lambda o: o["device"].update(gemm_efficiency=1.5), "device.gemm_efficiency must be a number in (0, 1]"),
    (lambda o: o["links"]["intra_node"].update(kind="ethernet"), "links.intra_node.kind must be one of"),
    (lambda o: o["links"]["inter_node"].update(kind="none", bandwidth_Bps=0),
     'links.inter_node.kind must not be "none" with num_nodes = 2'),
    (lambda o: o["device"].update(memory_bytes=True), "device.memory_bytes must be an integer >= 1, got true"),
])
def test_each_bad_field_is_named(tmp_path: pathlib.Path, mutate, message: str) -> None:
    obj = _spec_dict()
    mutate(obj)
    with pytest.raises(ClusterSpecError, match=None) as info:
        ClusterSpec.from_json(_write(tmp_path, obj))
    assert message in str(info.value)


def test_not_json_and_missing_file_are_clear(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ClusterSpecError, match="bad.json: not valid JSON"):
        ClusterSpec.from_json(str(bad))
    with pytest.raises(ClusterSpecError, match="cannot read"):
        ClusterSpec.from_json(str(tmp_path / "absent.json"))


def _profile() -> ClusterProfile:
    return ClusterProfile(note="synthetic", device=DeviceProfile(
        name="NVIDIA H100", torch_version="2.13", measured_on="2026-11-29",
        gemm=(GemmTiming(m=1024, n=1024, k=1024, dtype="bf16", seconds=1e-5),)))


def test_profile_inline_or_by_relative_path(tmp_path: pathlib.Path) -> None:
    spec = ClusterSpec.preset("dgx-h100", measured=False).with_profile(_profile())
    inline = tmp_path / "inline.json"
    spec.to_json(str(inline))
    assert ClusterSpec.from_json(str(inline)).profile == _profile()
    (tmp_path / "prof").mkdir()
    _profile().to_json(str(tmp_path / "prof" / "h100.json"))
    obj = ClusterSpec.preset("dgx-h100", measured=False).to_dict()
    obj["profile"] = "prof/h100.json"
    assert ClusterSpec.from_json(_write(tmp_path, obj)).profile == _profile()


def test_a_bare_profile_is_not_a_cluster_and_a_bad_profile_is_named(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "profile.json"
    _profile().to_json(str(path))
    with pytest.raises(ClusterSpecError, match='format must be "mplan.cluster"'):
        ClusterSpec.from_json(str(path))
    obj = ClusterSpec.preset("dgx-h100", measured=False).with_profile(_profile()).to_dict()
    obj["profile"]["device"]["gemm"][0]["seconds"] = 0
    with pytest.raises(ClusterSpecError, match=r"profile\.device\.gemm\[0\]\.seconds must be a positive number"):
        ClusterSpec.from_json(_write(tmp_path, obj))


def test_local_on_cpu_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    spec = ClusterSpec.local()
    assert (spec.name, spec.num_nodes, spec.gpus_per_node, spec.device.name) == ("local", 1, 4, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ClusterSpecError, match="WORLD_SIZE=6 is not a multiple of LOCAL_WORLD_SIZE=4"):
        ClusterSpec.local()
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ClusterSpecError, match="WORLD_SIZE must be a positive integer, got 'four'"):
        ClusterSpec.local()


def test_local_on_gpus_picks_the_nearest_preset_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=150 * 10**9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    spec = ClusterSpec.local()
    assert (spec.num_nodes, spec.gpus_per_node, spec.device.name) == (2, 8, "H200-SXM-141GB")
    props.name = "NVIDIA Mystery GPU"
    props.total_memory = 79 * 2**30
    with pytest.warns(UserWarning, match="no preset for GPU"):
        assert ClusterSpec.local().device.name == "H100-SXM5-80GB"  # nearest memory: 80 GiB


PLANNING_MODULES = ["cluster", "presets", "collective_cost", "collectives", "compute_cost", "simulator",
                    "memory_model", "alpha_beta", "profile", "dtypes", "log_interpolation",
                    "measure_device", "measure_links", "rates", "../json_fields"]


@pytest.mark.parametrize("module", PLANNING_MODULES)
def test_cost_models_do_not_import_torch_at_module_level(module: str) -> None:
    tree = ast.parse((REPO / "mplan" / "cost_models" / f"{module}.py").read_text())
    tops = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in tops if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in tops if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "torch" or n.startswith("torch.")]
