"""Every safetensors file aerie writes is a function of its content: same tensors and metadata, same bytes, in
any process (``aerie.tools.artifacts.write_safetensors``), and the safetensors library reads it back exactly."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from aerie.tools.artifacts import load_packed, save_packed, write_safetensors

# A shard like the stages write (packed tokens, bf16 hidden states, int8 aux, per-sequence metadata), built from a
# fixed seed in a fresh interpreter and saved with the given writer expression.
_WRITE_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import sys, torch
    from aerie.tools.artifacts import save_packed
    g = torch.Generator().manual_seed(7)
    tensors = {
        "input_ids": torch.randint(0, 50000, (300,), generator=g),
        "seq_offsets": torch.tensor([0, 100, 300]),
        "hidden": torch.randn(300, 16, generator=g).bfloat16(),
        "aux_q": torch.randint(-127, 128, (300, 48), generator=g, dtype=torch.int8),
        "aux_scale": torch.rand(300, 3, generator=g).half(),
        "loss_mask": torch.rand(300, generator=g) > 0.5,
    }
    meta = {"format": "aerie.test/1", "sample_ids": ["a", "b"], "n_seqs": 2}
    meta.update({f"key_{i:02d}": {"i": i, "ids": list(range(i))} for i in range(40)})
    save_packed(sys.argv[1], tensors, meta)
    """
)


def _write_in_fresh_process(path: Path, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    subprocess.run([sys.executable, "-c", _WRITE_IN_A_FRESH_PROCESS, str(path)], check=True, env=env, timeout=300)


def test_two_processes_write_identical_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _write_in_fresh_process(a, "1")
    _write_in_fresh_process(b, "2")
    assert a.read_bytes() == b.read_bytes()
    tensors, meta = load_packed(a, "aerie.test/1")
    assert meta["key_39"] == {"i": 39, "ids": list(range(39))} and tensors["hidden"].dtype == torch.bfloat16


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    floats = torch.randn(3, 5, generator=g)
    return {
        "f64": floats.double(),
        "f32": floats,
        "f16": floats.half(),
        "bf16": floats.bfloat16(),
        "f8_e4m3": floats.to(torch.float8_e4m3fn),
        "f8_e5m2": floats.to(torch.float8_e5m2),
        "i64": torch.randint(-(2**40), 2**40, (4, 2), generator=g),
        "i32": torch.randint(-(2**30), 2**30, (7,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15, (3,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 128, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (5,), generator=g, dtype=torch.uint8),
        "u16": torch.randint(0, 2**16, (3,), generator=g, dtype=torch.int32).to(torch.uint16),
        "u32": torch.randint(0, 2**31, (3,), generator=g, dtype=torch.int64).to(torch.uint32),
        "u64": torch.randint(0, 2**62, (3,), generator=g, dtype=torch.int64).to(torch.uint64),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "empty_i64": torch.zeros(0, dtype=torch.int64),
        "transposed": floats.t(),  # not contiguous: stored as its contiguous copy, as save_file does
        "odd_bf16": floats[0, :3].bfloat16(),  # 6 bytes: the next tensor must still start aligned
    }


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (float8 and unsigned types have no torch.equal on CPU)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))


def test_every_dtype_reads_back_as_the_library_writes_it(tmp_path: Path) -> None:
    tensors = _every_dtype()
    meta = {"format": "aerie.test/1", "ünïcode": "välue ✓", "json": json.dumps({"a": [1, 2]})}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_safetensors(ours, tensors, meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, theirs, metadata=meta)
    read_ours, read_theirs = load_file(ours), load_file(theirs)
    assert set(read_ours) == set(read_theirs) == set(tensors)
    for name, t in tensors.items():
        assert _same(read_ours[name], t), name
        assert _same(read_ours[name], read_theirs[name]), name
    with safe_open(str(ours), framework="pt") as f, safe_open(str(theirs), framework="pt") as g:
        assert f.metadata() == g.metadata() == meta
        assert _same(f.get_slice("f32")[1:3], tensors["f32"][1:3])


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def test_layout_aligned_contiguous_and_sorted(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    tensors = _every_dtype()
    meta = {f"k{i}": str(i) for i in range(30, 0, -1)}
    write_safetensors(path, tensors, meta)
    n, header = _header(path)
    raw = path.read_bytes()
    assert n % 8 == 0 and raw[8 : 8 + n].decode().endswith(("}", " "))
    assert list(header)[0] == "__metadata__" and list(header["__metadata__"]) == sorted(meta)
    entries = [(name, e) for name, e in header.items() if name != "__metadata__"]
    assert [name for name, _ in entries] == sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    end = 0
    for name, e in entries:
        begin, stop = e["data_offsets"]
        assert begin == end, name  # no holes, no overlap
        assert (8 + n + begin) % tensors[name].element_size() == 0, name  # aligned to its element size
        assert stop - begin == tensors[name].numel() * tensors[name].element_size(), name
        end = stop
    assert len(raw) == 8 + n + end
    # Same content given in another order, with metadata inserted in another order: the same bytes.
    again = tmp_path / "y.safetensors"
    write_safetensors(again, dict(reversed(list(tensors.items()))), dict(sorted(meta.items())))
    assert again.read_bytes() == raw


def test_no_tensors_and_no_metadata(tmp_path: Path) -> None:
    path = tmp_path / "nothing.safetensors"
    write_safetensors(path, {}, None)
    assert load_file(path) == {}
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() is None
    save_packed(tmp_path / "only_meta.safetensors", {}, {"format": "aerie.test/1"})
    assert load_packed(tmp_path / "only_meta.safetensors", "aerie.test/1") == ({}, {"format": "aerie.test/1"})


def test_bad_input_is_refused_with_the_file_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    with pytest.raises(TypeError, match="bad.safetensors.*str to str"):
        write_safetensors(path, {"x": torch.zeros(1)}, {"n": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="invalid tensor name"):
        write_safetensors(path, {"__metadata__": torch.zeros(1)}, None)
    with pytest.raises(TypeError, match="complex64"):
        write_safetensors(path, {"z": torch.zeros(2, dtype=torch.complex64)}, None)


def test_a_big_tensor_is_streamed_not_copied(tmp_path: Path) -> None:
    """Peak memory while writing a 256 MiB tensor grows by far less than the tensor: the writer streams each
    tensor's own memory to the file and never joins the file's bytes in memory."""
    script = textwrap.dedent(
        """
        import resource, sys, torch
        from aerie.tools.artifacts import write_safetensors
        t = torch.ones(64 << 20)  # 256 MiB of float32, no temporary
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        write_safetensors(sys.argv[1], {"t": t, "tail": torch.arange(3)}, {"format": "x"})
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    path = tmp_path / "big.safetensors"
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown_kib = int(proc.stdout.split()[-1])
    assert grown_kib < 64 << 10, f"peak RSS grew by {grown_kib} KiB while writing 256 MiB"
    assert path.stat().st_size > 256 << 20
    with safe_open(str(path), framework="pt") as f:
        assert f.get_slice("t")[-2:].tolist() == [1.0, 1.0] and f.get_tensor("tail").tolist() == [0, 1, 2]


def test_compare_runs_names_what_differs(tmp_path: Path) -> None:
    """bench/compare_runs.py (the two-run demo check of bench/RESULTS.md): identical files are counted, a
    differing file says what differs, and --must-match fails only on differences not waived."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import compare_runs

    a, b = tmp_path / "a", tmp_path / "b"
    tensors = {"hidden": torch.arange(6.0).reshape(2, 3), "ids": torch.arange(2)}
    for run, seconds, key in ((a, 1.5, "k1"), (b, 2.5, "k2")):
        (run / "results" / "x").mkdir(parents=True)
        save_packed(run / "results/x/tokens-00000.safetensors", tensors, {"format": "t/1", "n": 2})
        save_packed(run / "results/x/hidden-00000.safetensors", tensors, {"format": "h/1", "capture_key": key})
        (run / "results/x/report.json").write_text(json.dumps({"samples": 2, "timing": {"seconds": seconds}}))
    (b / "results/x/only_b.txt").write_text("x\n")
    rows, problems = compare_runs.compare(a, b)
    by_group = {r["group"]: r for r in rows}
    assert by_group["results/x/tokens-*.safetensors"]["identical"] == 1
    assert dict(problems) == {
        "results/x/hidden-00000.safetensors": "metadata capture_key",
        "results/x/report.json": "timing.seconds",
        "results/x/only_b.txt": "only in B",
    }
    assert "| `results/x/report.json` | 1 | 0 | timing.seconds |" in compare_runs.markdown(rows)
    assert compare_runs.main([str(a), str(b), "--must-match", "*.safetensors"]) == 1
    assert compare_runs.main([str(a), str(b), "--must-match", "*.safetensors", "--ignore-metadata", "capture_key"]) == 0
    assert compare_runs.main([str(a), str(b), "--must-match", "*.json", "--ignore-metadata", "capture_key"]) == 1
