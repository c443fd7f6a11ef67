"""The benchmark harness without running a benchmark: FLOPs, the time split, ratios, result files, the
markdown, the parent's reading of its children, and what the harness may import."""

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from horizon_ray.bench.child import parse_output
from horizon_ray.bench.cli import add_arguments
from horizon_ray.bench.metrics import (
    REQUIRED_KEYS,
    STATUSES,
    SYSTEMS,
    base_record,
    peak_holders,
    peak_site,
    split_from_trace,
    throughput,
)
from horizon_ray.bench.report import _mode_label, compute_ratios, load_results, merge_results, render, write_json
from horizon_ray.bench.shapes import TINY, model_flops_per_token, resolve_shape
from horizon_ray.bench.suite import HOST_OOM, Child, box_name, child_argv, collect

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _args(**kw):
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


# ---- FLOPs --------------------------------------------------------------------------------------------------


def test_flops_per_token_against_a_hand_count():
    """tiny: H 256, MLP 768, 8 layers, 4 heads of 64, 2 KV heads, vocab 8192, untied head; seq 128."""
    H, I, L, heads, kv, d, V, seq = 256, 768, 8, 4, 2, 64, 8192, 128
    per_layer = {"q": H * heads * d, "k": H * kv * d, "v": H * kv * d, "o": heads * d * H,
                 "gate": H * I, "up": H * I, "down": I * H}
    matmul_weights = L * sum(per_layer.values()) + V * H  # the LM head multiplies, the embedding looks up
    # a weight costs 2 FLOPs a token forward and 4 backward (grad of input, grad of weight)
    dense = (2 + 4) * matmul_weights
    # attention per layer and head: QK^T and AV, 2 * seq * d each a token forward; causal halves; x3 fwd+bwd
    attention = L * heads * 3 * (2 * 2 * seq * d) // 2
    assert model_flops_per_token(TINY, seq) == dense + attention == 51_904_512


def test_flops_match_the_reference_baseline_on_qwen_7b():
    """The reference script reported 414.9 model TFLOP/s at 9639.2 tokens/s (Qwen2.5-7B, seq 1024)."""
    shape = resolve_shape("qwen2.5-7b")
    assert throughput(16384, 16384 / 9639.2, model_flops_per_token(shape, 1024))["model_tflops"] == 414.9


def test_throughput_and_mfu():
    t = throughput(tokens_per_step=1000, step_s=2.0, flops_per_token=786.5e9 * 2)
    assert t["tokens_per_s"] == 500.0
    assert t["model_tflops"] == 786.5
    assert t["mfu_measured"] == 1.0
    assert t["mfu_datasheet"] == pytest.approx(786.5 / 989.5, abs=1e-4)


def test_shapes_resolve_presets_depths_and_tiny():
    assert 9e6 < TINY.num_params < 12e6
    assert resolve_shape("qwen2.5-14b@20L").num_layers == 20
    assert resolve_shape("qwen2.5-7b", layers=4).name == "qwen2.5-7b@4L"
    assert resolve_shape(resolve_shape("qwen2.5-7b", layers=4).name).num_layers == 4
    with pytest.raises(ValueError, match="unknown shape"):
        resolve_shape("gpt-5")
    with pytest.raises(ValueError, match="NAME@<layers>L"):
        resolve_shape("qwen2.5-7b@x")


# ---- the profiled step's split -----------------------------------------------------------------------------


def test_split_from_trace_counts_only_copies_not_under_compute():
    us = 1e6
    events = [
        {"ph": "X", "cat": "kernel", "ts": 0, "dur": 0.4 * us},
        {"ph": "X", "cat": "kernel", "ts": 0.3 * us, "dur": 0.2 * us},  # overlaps the first: union 0.0-0.5
        {"ph": "X", "cat": "gpu_memset", "ts": 0.9 * us, "dur": 0.1 * us},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 0.4 * us, "dur": 0.3 * us},  # 0.1 hidden under compute, 0.2 exposed
        {"ph": "X", "cat": "gpu_memcpy", "ts": 1.2 * us, "dur": 0.1 * us},  # exposed
        {"ph": "X", "cat": "cuda_runtime", "ts": 0, "dur": 2 * us},  # host side: ignored
        {"ph": "i", "cat": "kernel", "ts": 0},  # not a span
    ]
    s = split_from_trace(events, step_s=2.0)
    assert s["gpu_compute_s"] == pytest.approx(0.6)
    assert s["exposed_copy_s"] == pytest.approx(0.3)
    assert s["gpu_idle_s"] == pytest.approx(1.1)
    assert s["profiled_step_s"] == 2.0


def test_a_profiled_step_says_where_its_gpu_idles():
    """The GPU's idle time split by the length of its gaps (launch latency against host waits), the host time
    before the first and after the last activity, and the longest gaps named by the work around them."""
    us = 1e6
    spans = [("gemm_a", 0.10, 0.20), ("Memcpy HtoD", 0.15, 0.30), ("norm_b", 0.30 + 10e-6, 0.40),
             ("gemm_c", 0.40 + 500e-6, 0.60), ("adam_wait_after", 0.90, 1.00), ("gemm_d", 0.95, 0.99)]
    events = [{"ph": "X", "cat": "gpu_memcpy" if n.startswith("Memcpy") else "kernel", "name": n, "ts": a * us,
               "dur": (b - a) * us} for n, a, b in spans]
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 2 * us})
    gaps = split_from_trace(events, step_s=1.2)["idle_gaps"]
    assert gaps["by_length_s"] == pytest.approx({"under 20 us": 10e-6, "20 us to 1 ms": 500e-6,
                                                 "1 ms and more": 0.3})
    assert gaps["edges_s"] == pytest.approx(0.3)  # 0.1 before the first activity, 0.2 after the last
    assert [g[1:] for g in gaps["longest"]] == [["gemm_c", "adam_wait_after"], ["norm_b", "gemm_c"],
                                                ["Memcpy HtoD", "norm_b"]]
    assert gaps["longest"][0][0] == pytest.approx(300.0)  # ms
    from horizon_ray.bench.suite import idle_line

    line = idle_line({"gpu_idle_s": 0.5}, gaps)
    assert "0.300 s in gaps 1 ms and more" in line and "300.0 ms after gemm_c before adam_wait_after" in line


def test_a_profiled_step_tables_its_kernels_by_class_and_name():
    """The kernel time of a profiled step by what the kernels do, and its heaviest kernels by name: what the
    closing notes compare between the engine and HF + Liger."""
    us = 1e6
    k = [("sm90_xmma_gemm_bf16bf16_bf16f32", 0.5), ("sm90_xmma_gemm_bf16bf16_bf16f32", 0.25),
         ("_rms_norm_forward_kernel", 0.1), ("flash_fwd_kernel", 0.2), ("_triton_rope", 0.05),
         ("_swiglu_backward_kernel", 0.07), ("liger_cross_entropy_kernel", 0.03),
         ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 0.04)]
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": 0, "dur": d * us} for n, d in k]
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": us})  # not a kernel
    s = split_from_trace(events, step_s=2.0)
    assert s["kernel_s_by_class"] == {"GEMM": 0.75, "attention": 0.2, "norm": 0.1, "activation": 0.07,
                                      "RoPE": 0.05, "elementwise and other": 0.04, "cross-entropy": 0.03}
    assert s["top_kernels"][0] == ["sm90_xmma_gemm_bf16bf16_bf16f32", 0.75, 2]
    assert [t[0] for t in s["top_kernels"][1:3]] == ["flash_fwd_kernel", "_rms_norm_forward_kernel"]


def test_a_steps_peak_is_named_by_the_code_that_holds_it():
    """The allocator's history of a step replayed to its peak: the blocks live then, summed by the engine code
    that allocated them; what the step freed of the buffers allocated before it comes off their holder, and a
    block freed before the peak holds nothing."""
    def frame(file, name, line):
        return {"filename": f"/repo/horizon_ray/engine/{file}", "name": name, "line": line}

    torch_frame = {"filename": "/site/torch/nn/functional.py", "name": "silu", "line": 1}
    act = [torch_frame, frame("layers.py", "_mlp", 40), frame("layers.py", "layer", 90),
           {"filename": "/repo/horizon_ray/bench/engine_run.py", "name": "_measure", "line": 5}]
    loss = [frame("objective.py", "chunk_loss", 12), frame("engine.py", "train_step", 300)]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": act},
        {"action": "alloc", "addr": 2, "size": 50, "frames": act},
        {"action": "alloc", "addr": 3, "size": 400, "frames": loss},
        {"action": "free_requested", "addr": 3, "size": 400},
        {"action": "free_completed", "addr": 3, "size": 400},  # the loss chunk is gone before the peak
        {"action": "free_completed", "addr": 99, "size": 30},  # of the buffers from before the step
        {"action": "alloc", "addr": 4, "size": 500, "frames": []},  # autograd's thread: no Python frame
        {"action": "alloc", "addr": 5, "size": 20, "frames": [torch_frame]},
        {"action": "free_completed", "addr": 4, "size": 500},
        {"action": "alloc", "addr": 6, "size": 10, "frames": act},
    ]
    out = peak_holders(trace, before=1000, top=2)
    assert out["gpu_peak_traced_bytes"] == 1000 + 150 + 400 - 400 - 30 + 500 + 20  # 1640, before addr 4's free
    assert out["gpu_peak_holders"] == [["before the step (engine buffers)", 970, 0],
                                       ["backward (no Python frame)", 500, 1],
                                       ["layers.py:_mlp:40 < layers.py:layer", 150, 2],
                                       ["other", 20, 1]]
    assert sum(h[1] for h in out["gpu_peak_holders"]) == out["gpu_peak_traced_bytes"]
    assert peak_site([torch_frame]) == "functional.py:silu"
    from horizon_ray.bench.suite import peak_lines

    lines = peak_lines({**out, "planned_gpu_bytes": 3 * 2**20, "planned_gpu_items": {"loss_workspace": 2**20}})
    assert lines[0] == "0 MiB allocated at the step's peak, planned 3 MiB (loss_workspace 1)"
    assert lines[2].split() == ["0.0", "MiB", "1", "blocks", "backward", "(no", "Python", "frame)"]


# ---- records, ratios, files ----------------------------------------------------------------------------------


def _run(system, tps, tokens=16384, status="ok", run_id="r1", date="2026-11-29", mode="exact", **kw):
    rec = base_record(system, TINY, mode=mode, dtype="bfloat16", device="cuda", device_name="NVIDIA H200",
                      seq=1024, micro=tokens // 1024, accum=1, checkpoint_every=1, gpu_budget_bytes=None,
                      flops_per_token=model_flops_per_token(TINY, 1024),
                      update=kw.pop("update", "exact" if system == "horizon-ray" else None))
    rec.update(status=status, tokens_per_s=tps, step_s=tokens / tps if tps else None, date=date,
               box="h200", commit="abc1234", run_id=run_id, command="python -m horizon_ray.bench --shape tiny", **kw)
    return rec


def test_every_record_carries_the_required_keys():
    rec = _run("horizon-ray", 100.0)
    assert list(rec)[: len(REQUIRED_KEYS)] == list(REQUIRED_KEYS)


def test_ratio_is_against_the_baseline_of_the_same_run_and_tokens_per_step():
    runs = [
        _run("horizon-ray", 50.0), _run("in-gpu-baseline", 100.0), _run("fsdp2-offload", 25.0),
        _run("horizon-ray", 90.0, tokens=65536), _run("in-gpu-baseline", 120.0, tokens=65536),
        _run("horizon-ray", 80.0, run_id="r2"),  # another invocation: no baseline of its own
        _run("fsdp2-offload", None, status="did-not-fit", reason="host OOM"),
    ]
    compute_ratios(runs)
    assert [r["ratio"] for r in runs] == [0.5, 1.0, 0.25, 0.75, 1.0, None, None]
    assert runs[0]["baseline_tokens_per_s"] == 100.0 and runs[3]["baseline_tokens_per_s"] == 120.0
    assert runs[5]["baseline_tokens_per_s"] is None


def _write_results(d: Path) -> None:
    write_json(d / "2026-11-29-h200-tiny.json", [
        _run("horizon-ray", 50.0, planned_host_bytes=2**30, host_rss_bytes=2**30, exposed_optimizer_s=0.5,
             optimizer_update_s=0.6),
        _run("in-gpu-baseline", 100.0),
        _run("fsdp2-offload", None, status="not-run", reason="not run on the GPU box this session"),
    ])
    write_json(d / "2026-11-30-h200-tiny.json", [_run("horizon-ray", 70.0, run_id="r3", date="2026-11-30"),
                                                 _run("in-gpu-baseline", 100.0, run_id="r3", date="2026-11-30")])


def test_results_md_is_regenerated_deterministically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write_results(a)
    b.mkdir()
    for f in sorted(a.glob("*.json"), reverse=True):  # another creation order
        shutil.copy(f, b / f.name)
    text = render(a)
    assert text == render(a) == render(b)
    rows = [ln for ln in text.splitlines() if re.match(r"\| \d+ \| ", ln)]
    assert len(rows) == 4  # the not-run placeholder is listed under "Not measured", not as a row
    assert "2026-11-30" in rows[0]  # newest first
    assert "| 0.500 |" in rows[2] and "| 1.000 |" in rows[3]
    assert "**not-run**: not run on the GPU box this session" in text
    assert "No FSDP2 CPU-offload numbers from a GPU exist yet" in text
    assert "Bound by the host optimizer" not in text  # 0.5 s exposed of a 327 s step
    assert "`python -m horizon_ray.bench --shape tiny`" in text


def test_the_matrix_holds_each_settings_newest_gpu_row_with_its_own_peers_and_plan(tmp_path):
    """One line per setting (shape, mode and its settings, update, base, tokens per step): the newest invocation's
    horizon-ray row, its ratio to the peer of that invocation, its step and RSS beside the plan's, and the row of
    the table below; CPU rows and peers' rows are not in it."""
    write_json(tmp_path / "2026-11-29-h200-tiny.json", [
        _run("horizon-ray", 50.0, run_id="2026-11-29-h200-090000-1", planned_step_s=0.3),
        _run("in-gpu-baseline", 100.0, run_id="2026-11-29-h200-090000-1"),
        _run("horizon-ray", 80.0, run_id="2026-11-29-h200-120000-2", planned_step_s=0.2,
             host_rss_bytes=3 * 2**30, rss_plan_host_bytes=2 * 2**30),
        _run("in-gpu-baseline", 160.0, run_id="2026-11-29-h200-120000-2"),
        _run("horizon-ray", 40.0, run_id="2026-11-29-h200-100000-3", update="delayed"),
        _run("horizon-ray", 9.0, run_id="2026-11-29-h200-130000-4", device="cpu"),
        _run("horizon-ray", 7.0, run_id="2026-11-29-h200-run9"),  # an id without its time: older than timed ones
    ])
    text = render(tmp_path)
    head, table = text.split("## The matrix", 1)[1].split("\n| # |", 1)
    lines = [ln for ln in head.splitlines() if ln.startswith("| h200 |")]
    assert len(lines) == 2, lines
    exact = next(ln for ln in lines if "| exact | none |" in ln)
    cells = [c.strip() for c in exact.strip("|").split("|")]
    # the 12:00 invocation, not the 09:00 one: 80 tok/s, 0.5x its own peer (160), not 0.8x the older peer
    assert cells[5:13] == ["1024", "—", "16,384", "80", "0.500", "—", "204.800 (0.200)", "3.0 (2.0)"], cells
    row = int(cells[13].lstrip("#"))
    table_rows = [ln for ln in ("| # |" + table).splitlines() if re.match(r"\| \d+ \| ", ln)]
    assert table_rows[row - 1].split("|")[5].strip() == "horizon-ray" and "| 80 |" in table_rows[row - 1]
    assert any("| delayed | none |" in ln and "| 40 |" in ln for ln in lines)
    assert text.index("## The matrix") < text.index("## Every row") < text.index("| # | date |")
    assert "\n\n## The matrix" in text and "\n\n## Every row\n\n| # | date |" in text


def test_a_delayed_row_timed_shorter_than_its_update_is_marked_with_what_it_sustains(tmp_path):
    """A delayed-update row whose timed steps were shorter than its host update, and waited for it, was timed
    before its pipeline was steady: the matrix shows the most it sustains (over its longest timed step) beside
    what it measured, its own and its ratio, and its paragraph says why; a row whose step covers its update, or
    whose steps did not wait for the update it recorded, is left alone."""
    run = "2026-12-01-h200-090000-1"
    short = _run("horizon-ray", 16384 / 1.12, run_id=run, update="delayed", optimizer_update_s=1.9,
                 exposed_optimizer_s=0.42, step_times=[0.79, 1.44])
    steady = _run("horizon-ray", 65536 / 2.2, tokens=65536, run_id=run, update="delayed", optimizer_update_s=1.9,
                  exposed_optimizer_s=0.0, step_times=[2.2, 2.2])
    # shorter than the update it recorded, but its steps did not wait: that update ran within them
    unwaited = _run("horizon-ray", 16384 / 1.6, run_id="2026-12-01-h200-100000-2", update="delayed", seq_len=512,
                    optimizer_update_s=4.5, exposed_optimizer_s=0.013, step_times=[1.6, 1.6])
    write_json(tmp_path / "2026-12-01-h200-tiny.json", [
        short, steady, unwaited, _run("in-gpu-baseline", 22000.0, run_id=run)])
    text = render(tmp_path)
    head = text.split("## The matrix", 1)[1].split("## Every row", 1)[0]
    line = next(ln for ln in head.splitlines() if "| 16,384 |" in ln and "| 1024 |" in ln)
    assert "| 14,629 (steady <= 11,378) | 0.665 (steady <= 0.517) |" in line, line
    assert "steady <=" not in next(ln for ln in head.splitlines() if "| 65,536 |" in ln)
    assert "steady <=" not in next(ln for ln in head.splitlines() if "| 512 |" in ln)
    assert "its timed steps (0.79, 1.44 s) were shorter than its host update (1.90 s) and waited for it" in text
    assert "it sustains at most 11,378 tok/s (its longest timed step)" in text and text.count("sustains at most") == 1


def test_merge_keeps_local_runs_and_adds_new_ones_once(tmp_path):
    local, box = tmp_path / "local", tmp_path / "box"
    _write_results(local)
    write_json(box / "2026-11-29-h200-tiny.json", [_run("fsdp2-offload", 30.0, run_id="r9"),
                                                   _run("in-gpu-baseline", 100.0, run_id="r9")])
    assert merge_results(box, local) == 2
    assert merge_results(box, local) == 0
    runs = json.loads((local / "2026-11-29-h200-tiny.json").read_text())
    assert [r["system"] for r in runs] == ["horizon-ray", "in-gpu-baseline", "fsdp2-offload", "fsdp2-offload",
                                           "in-gpu-baseline"]


def test_a_run_without_a_required_key_is_refused(tmp_path):
    run = _run("horizon-ray", 1.0)
    del run["planned_host_bytes"]
    write_json(tmp_path / "x.json", [run])
    with pytest.raises(ValueError, match="planned_host_bytes"):
        load_results(tmp_path)


def test_committed_results_follow_the_schema_and_results_md_is_current():
    runs = [r for _, r in load_results(RESULTS)]
    assert runs, "benchmarks/results holds no result file"
    for r in runs:
        assert r["system"] in SYSTEMS and r["status"] in STATUSES
        if r["status"] == "ok":
            assert r["tokens_per_s"] > 0 and r["tokens_per_step"] == r["seq_len"] * r["micro"] * r["accum"]
    before = [(r["ratio"], r["baseline_tokens_per_s"]) for r in runs]
    assert [(r["ratio"], r["baseline_tokens_per_s"]) for r in compute_ratios(runs)] == before
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == render(RESULTS), \
        "RESULTS.md is stale: run `python -m horizon_ray.bench --report`"


def test_a_measured_row_is_planned_again_by_this_commits_planner_from_its_own_settings():
    """RESULTS.md's planner check: olmoe-1b-7b full, delayed update, 16,384 tokens a step (56c111e, 2,048-token loss
    chunks from its command, 12 GiB budget) replanned from its record is the plan of those settings; a peer's
    row or a CPU row is not planned."""
    from horizon_ray.bench.planning import replan
    from horizon_ray.planner import plan

    runs = json.loads((RESULTS / "2026-12-05-h200-olmoe-1b-7b.json").read_text())
    row = next(r for r in runs if r["update"] == "delayed" and r["tokens_per_step"] == 16384)
    assert "--loss-chunk 2048" in row["command"] and row["planned_step_s"] == 2.57  # the planner of its commit
    want = plan("olmoe-1b-7b", seq_len=1024, micro_batch_size=16, grad_accum=1, checkpoint_every=1,
                loss_chunk_tokens=2048, gpu_budget_bytes=12 * 2**30, update="delayed", suggest=False,
                layer_chunk_tokens=8192)  # the bench's row groups then and now (the job spec's default: auto)
    got = replan(row)
    assert got["planned_step_s"] == round(want.step_time_s, 3) < 2.0 and got["planned_gpu_bytes"] == want.gpu_bytes
    assert replan({**row, "system": "in-gpu-baseline"}) is None and replan({**row, "device": "cpu"}) is None
    assert replan({k: v for k, v in row.items() if k != "command"}) is None
    text = render(RESULTS)
    section = text[text.index("## The planner of this commit against the matrix"):text.index("## Every row")]
    assert re.search(r"\| olmoe-1b-7b \| exact, ckpt host \(auto\) \| delayed \| 16,384 \| 1\.482 \| 2\.570 \| "
                     rf"{got['planned_step_s']:.3f} \|", section)


def test_the_planner_check_holds_a_plan_against_the_memory_a_row_held():
    """A row's peak GPU memory, for the planner check, counts what the allocator held as active (a block freed
    while another stream's use of it was pending), where the row recorded it: max_memory_allocated alone
    understated the profiled qwen3-4b step by 447 MiB."""
    from horizon_ray.bench.report import gpu_held

    assert gpu_held({"peak_gpu_bytes": 6938, "peak_gpu_active_bytes": 7385}) == 7385
    assert gpu_held({"peak_gpu_bytes": 6938}) == 6938  # rows from before the active bytes were recorded
    assert gpu_held({"peak_gpu_bytes": 0, "peak_gpu_active_bytes": 0}) is None  # a CPU row


def test_the_h200_7b_record():
    runs = json.loads((RESULTS / "2026-11-29-h200-qwen2.5-7b-run8.json").read_text())
    hr = {r["accum"]: r for r in runs if r["system"] == "horizon-ray"}
    assert hr[1]["ratio"] == round(3086.2 / 9639.2, 3) and hr[4]["ratio"] == round(6936.3 / 9840.2, 3)
    assert all(r["commit"] == "59969c9" and r["planned_host_bytes"] > 100 * 2**30 for r in hr.values())
    assert {r["status"] for r in runs if r["system"] == "fsdp2-offload"} == {"not-run"}


# ---- the parent and its children ----------------------------------------------------------------------------


def test_parse_output_keeps_the_last_record_of_each_accumulation_and_update():
    first = {"accum": 1, "tokens_per_s": 1.0}
    delayed = {"accum": 1, "update": "delayed", "tokens_per_s": 2.0}
    lines = ["noise", "RESULT " + json.dumps(first), "RESULT " + json.dumps({**first, "gpu_compute_s": 0.5}),
             "RESULT " + json.dumps(delayed),
             "FAILED " + json.dumps({"status": "did-not-fit", "reason": "OutOfMemoryError: x"})]
    records, failed = parse_output(lines)
    assert records == {(1, None): {"accum": 1, "tokens_per_s": 1.0, "gpu_compute_s": 0.5}, (1, "delayed"): delayed}
    assert failed["status"] == "did-not-fit"


def test_a_child_killed_by_the_host_oom_killer_did_not_fit():
    args = _args(shape="tiny", accum="1,4", device="cpu")
    done = _run("horizon-ray", 10.0)
    done["accum"] = 1
    child = Child(lines=["RESULT " + json.dumps(done)], returncode=-9)
    got = collect(child, "horizon-ray", "tiny", args, "cpu", "float32", "exact", "auto")
    assert [r["accum"] for r in got] == [1, 4]
    assert got[0]["status"] == "ok"
    assert got[1]["status"] == "did-not-fit" and got[1]["reason"] == HOST_OOM
    assert got[1]["planned_host_bytes"] > 0 and set(REQUIRED_KEYS) <= set(got[1])


def test_a_child_that_timed_out_or_crashed():
    args = _args(shape="tiny", device="cpu")
    timed_out = collect(Child(returncode=-9, timed_out=True, wall_s=12), "in-gpu-baseline", "tiny", args, "cpu",
                        "float32", None, None)
    assert timed_out[0]["status"] == "timeout"
    crashed = collect(Child(lines=["Traceback", "KeyError: 'x'"], returncode=1), "fsdp2-offload", "tiny", args,
                      "cpu", "float32", None, None)
    assert crashed[0]["status"] == "error" and "KeyError" in crashed[0]["reason"]


def test_child_argv_passes_each_system_its_own_knobs():
    args = _args(shape="qwen2.5-7b", accum="1,4", gpu_budget_gib=12, fsdp_gpu_budget_gib=40)
    hr = child_argv("horizon-ray", "qwen2.5-7b", args, "cuda", "bfloat16", "exact", "false")
    assert hr[hr.index("--gpu-budget-gib") + 1] == "12" and hr[hr.index("--offload") + 1] == "false"
    base = child_argv("in-gpu-baseline", "qwen2.5-7b", args, "cuda", "bfloat16", None, None)
    assert "--gpu-budget-gib" not in base and "--mode" not in base
    fsdp = child_argv("fsdp2-offload", "qwen2.5-7b", args, "cuda", "bfloat16", None, None)
    assert fsdp[fsdp.index("--fsdp-gpu-budget-gib") + 1] == "40"


def test_box_names():
    assert box_name("cuda:0", "NVIDIA H200") == "h200"
    assert box_name("cuda", "NVIDIA H100 80GB HBM3") == "h100"
    assert box_name("cpu", "") == "cpu"


def test_fused_adamw_falls_back_to_foreach_when_its_first_step_fails(monkeypatch):
    import torch

    from horizon_ray.bench.hf import FallbackAdamW

    w = torch.nn.Parameter(torch.ones(4))
    opt = FallbackAdamW([w])
    assert opt.name == "AdamW fused"

    def broken(*a, **k):
        raise NotImplementedError("no fused kernel for this tensor type")

    monkeypatch.setattr(torch, "_fused_adamw_", broken)
    w.grad = torch.ones(4)
    opt.step()
    assert opt.name == "AdamW foreach" and "NotImplementedError" in opt.fell_back
    assert torch.all(w < 1)


INSTALL_LIGER = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
                 "export PYTHONPATH=/tmp/site:$PWD && ")


def test_readme_commands_parse():
    """Every command of benchmarks/README.md for the GPU box is a valid invocation that writes to $OUT; one that
    runs a Liger-Kernel peer (named or by default) or horizon-ray (whose fused kernels are Liger-Kernel's), or
    quantizes a base (bitsandbytes), installs the carried wheels first and puts them on PYTHONPATH; the one-call
    7B comparisons of issues 14 and 15 are there."""
    from horizon_ray.bench.metrics import LIGER
    from horizon_ray.bench.suite import default_systems

    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    cmds = [ln for ln in (ROOT / "benchmarks" / "README.md").read_text().splitlines()
            if "python3 -m horizon_ray.bench" in ln and "$OUT" in ln]
    assert len(cmds) >= 6
    parsed = []
    for cmd in cmds:
        words = shlex.split(cmd.replace("$OUT", "/tmp/out").replace("<commit>", "abc1234"))
        args = p.parse_args(words[words.index("horizon_ray.bench") + 1:])
        assert args.results_dir.startswith("/tmp/out") and args.time_limit_s <= 560, cmd
        systems = args.systems.split(",") if args.systems else default_systems(args)
        if set(systems) & {*LIGER, "horizon-ray"} or args.quantize not in (None, "none"):  # bitsandbytes too
            assert cmd.startswith(INSTALL_LIGER), cmd
        else:
            assert cmd.startswith("PYTHONPATH=$PWD python3 -m horizon_ray.bench"), cmd
        parsed.append((args, systems))
    full = [(a, s) for a, s in parsed if a.shape == "qwen2.5-7b" and a.update == "exact,delayed,speculative"]
    assert [(a.accum, a.micro, a.seq, a.gpu_budget_gib, s) for a, s in full] == [
        ("1,4", 16, 1024, 12, ["horizon-ray", "in-gpu-liger", "in-gpu-baseline"])]  # 16,384 and 65,536 tokens
    lora = [(a, s) for a, s in parsed if a.shape == "qwen2.5-7b" and a.mode == "lora"]
    assert [(a.accum, a.lora_r, s) for a, s in lora] == [("1,4", 16, ["horizon-ray", "in-gpu-peft-liger",
                                                                      "in-gpu-peft"])]


# ---- what the harness imports -----------------------------------------------------------------------------


def test_the_engine_does_not_import_the_bench():
    code = ("import sys, horizon_ray.engine\n"
            "assert not [m for m in sys.modules if m.startswith('horizon_ray.bench')]\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_parent_imports_no_torch_and_no_module_the_gpu_box_lacks():
    code = (
        "import sys\n"
        "import horizon_ray.bench.suite, horizon_ray.bench.report, horizon_ray.bench.cli, horizon_ray.commands.bench\n"
        "assert 'torch' not in sys.modules\n"
        "import horizon_ray.bench.engine_run, horizon_ray.bench.baseline, horizon_ray.bench.fsdp2\n"
        "import horizon_ray.bench.peft_peer\n"
        "bad = [m for m in ('ray', 'fastapi', 'pydantic', 'uvicorn', 'starlette', 'psutil', 'rich')\n"
        "       if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- review fixes: LoRA placeholders, trainable parameters, RSS against the right plan, run9's baseline ---------


def test_a_failed_lora_child_is_recorded_with_its_plan():
    from horizon_ray.bench.suite import _placeholders
    from horizon_ray.planner import Adapters, plan
    from horizon_ray.planner.shapes import adapter_params

    args = _args(shape="tiny", accum="1,2", device="cpu", mode="lora", lora_r=4, lora_targets="q_proj,v_proj")
    got = collect(Child(lines=["Traceback", "RuntimeError: boom"], returncode=1), "horizon-ray", "tiny", args,
                  "cpu", "float32", "lora", "auto")
    assert [(r["status"], r["accum"]) for r in got] == [("error", 1), ("error", 2)]
    lora = Adapters(r=4, targets=("q_proj", "v_proj"))
    want = plan(TINY, method="lora", lora=lora, seq_len=1024, micro_batch_size=16, grad_accum=1, checkpoint_every=1,
                compute_dtype="float32", device="cpu", loss_chunk_tokens=1024)
    assert got[0]["planned_host_bytes"] == want.host_bytes  # the run's rank and targets, not the defaults
    assert got[0]["trainable_params"] == want.trainable_params == adapter_params(lora, TINY)
    # settings the planner refuses are recorded, not raised
    bad = _placeholders("horizon-ray", "tiny", _args(shape="tiny", device="cpu", mode="lora", lora_targets="qkv"),
                        "cpu", "float32", "lora", "auto", "error", "x")
    assert bad[0]["planned_host_bytes"] is None and "lora.targets ['qkv'] are not valid" in bad[0]["plan_error"]


def test_child_argv_passes_the_lora_settings():
    args = _args(shape="tiny", mode="lora", lora_r=4, lora_targets="q_proj,v_proj")
    argv = child_argv("horizon-ray", "tiny", args, "cpu", "float32", "lora", "auto")
    assert argv[argv.index("--lora-r") + 1] == "4" and argv[argv.index("--lora-targets") + 1] == "q_proj,v_proj"
    assert "--lora-r" not in child_argv("horizon-ray", "tiny", args, "cpu", "float32", "exact", "auto")


def test_what_bounds_a_lora_row_counts_the_adapters():
    from horizon_ray.bench.report import _bound

    shape = resolve_shape("qwen2.5-7b")
    rec = base_record("horizon-ray", shape, mode="lora", dtype="bfloat16", device="cuda", device_name="", seq=1024,
                      micro=16, accum=1, checkpoint_every=1, gpu_budget_bytes=None, flops_per_token=1.0,
                      trainable_params=20_185_088)
    rec.update(step_s=2.0, optimizer_update_s=0.01, exposed_optimizer_s=0.0)
    assert "the host AdamW updates 0.02 G params in 0.01 s" in _bound(rec, None)
    del rec["trainable_params"]  # a record from before the field: LoRA's count is unknown, not the base's
    assert "the host AdamW updates the adapters in 0.01 s" in _bound(rec, None)
    full = base_record("horizon-ray", shape, mode="exact", dtype="bfloat16", device="cuda", device_name="", seq=1024,
                       micro=16, accum=1, checkpoint_every=1, gpu_budget_bytes=None, flops_per_token=1.0)
    assert full["trainable_params"] == full["params"] == 7_615_616_512


def test_a_rows_planned_bound_is_written_as_its_arithmetic():
    """A record's ``bound`` is the planner's roofline (a dict, since the records of 2026-12-01) or a diagnosis
    recorded with the run (a string): the first is written as bytes, FLOPs and seconds, not as a dict."""
    from horizon_ray.bench.report import _bound

    rec = _run("horizon-ray", 6818.6, tokens=16384)
    rec.update(step_s=2.403, optimizer_update_s=0.25, exposed_optimizer_s=0.0,
               bound={"h2d_bytes": 124182629376, "d2h_bytes": 5791285248, "host_update_bytes": 17990418432,
                      "gpu_flops": 322105367330816.0, "bound": "pcie", "pcie_s": 2.23, "optimizer_s": 0.238,
                      "compute_s": 0.569, "exposed_s": 0.011, "step_s": 2.242})
    text = _bound(rec, None)
    # no profiled step split the measured time: what bounds it is the plan's word
    assert text.startswith("Bound by pcie, by the plan's roofline (no profiled step): ") and "{" not in text
    assert ("the plan's arithmetic: PCIe 124.2 GB in + 5.8 GB out = 2.23 s; host update 18.0 GB = 0.24 s; "
            "GPU 322 TFLOP = 0.57 s; bound: pcie") in text
    rec["bound"] = "the optimizer kernel holding the GIL"
    assert _bound(rec, None).startswith("Bound by the optimizer kernel holding the GIL: ")


def test_the_bench_decides_projections_and_row_groups_auto_as_a_job_does():
    """--projections auto and --layer-chunk auto (the defaults) decide as the job spec's engine.fuse_projections
    and engine.layer_chunk_tokens do: the row groups the planner fits in --gpu-budget-gib at the largest --accum
    (the run's one engine serves them all), 8,192 on the CPU; split GEMMs from 16,384-token row groups on a GPU."""
    from horizon_ray.bench.engine_run import resolved_layer_chunk, resolved_projections
    from horizon_ray.bench.planning import lora_settings, planned_bytes

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--micro", "16", "--seq", "1024", "--loss-chunk", "2048", "--accum", "1,4"])
    assert (args.projections, args.layer_chunk) == ("auto", "auto")
    assert resolved_projections(args, "cuda:0", 8192) == "fused"
    assert resolved_projections(args, "cuda:0", 16384) == "split"
    assert resolved_projections(args, "cpu", 16384) == "fused"
    args.micro = 4  # a micro-batch of 4,096 tokens: its row group is no larger
    assert resolved_projections(args, "cuda:0", 16384) == "fused"
    args.micro = 16
    shape = resolve_shape("qwen2.5-7b")

    def chunk(budget_gib, device="cuda:0"):
        args.gpu_budget_gib = budget_gib
        return resolved_layer_chunk(args, shape, device, "bfloat16", lora_settings(args, "exact", shape), ["exact"])

    need = {c: planned_bytes(shape, mode="exact", seq=1024, micro=16, accum=4, checkpoint_every=1, dtype="bfloat16",
                             device="cuda", gpu_budget_bytes=None, loss_chunk=2048, offload="auto",
                             layer_chunk=c)["planned_gpu_bytes"] / 2**30 for c in (16384, 8192)}
    assert (chunk(need[16384] + 0.01), chunk(need[16384] - 0.01), chunk(need[8192] - 0.01)) == (16384, 8192, 4096)
    assert chunk(need[16384] + 0.01, device="cpu") == 8192
    args.layer_chunk = 16384
    assert chunk(1) == 16384  # a number stays
    args.projections = "split"
    assert resolved_projections(args, "cpu", 8192) == "split"


def test_host_rss_is_compared_with_the_largest_plan_the_process_ran():
    from horizon_ray.bench.engine_run import accumulations, rss_plan
    from horizon_ray.bench.report import _bound

    assert accumulations("4,1") == [1, 4]
    big = _run("horizon-ray", 6640.5, tokens=65536, planned_host_bytes=121869120512)
    small = _run("horizon-ray", 4204.2, tokens=16384, planned_host_bytes=111651795968, host_rss_bytes=121586847744)
    largest = rss_plan(big, None)  # run9's order: 65,536 tokens, then 16,384 in the same engine
    assert rss_plan(small, largest) is big
    assert (small["rss_plan_host_bytes"], small["rss_plan_tokens_per_step"]) == (121869120512, 65536)
    assert (big["rss_plan_host_bytes"], big["rss_plan_tokens_per_step"]) == (121869120512, 65536)
    assert ("host RSS 113.2 GiB against 113.5 GiB planned for the 65,536-token step that ran before it in the same "
            "process (-0.2%; this step's own plan: 104.0 GiB)") in _bound(small, None)


def test_a_row_above_its_rss_plan_says_what_the_excess_is_made_of():
    """The qwen3-30b-a3b nf4 rows of 2026-12-04 ran 2.0 GB above their plan, with nothing recorded to tell mapped
    code from freed heap; a row now records both, and its line says them where RSS is more than 1 % above."""
    from horizon_ray.bench.report import _bound

    # that row's RSS and plan, with a split of the excess made up for the test (the box recorded none)
    row = _run("horizon-ray", 10132.0, planned_host_bytes=31872670720, host_rss_bytes=33914773504,
               host_rss_file_bytes=int(0.75 * 2**30), host_heap_free_bytes=int(1.25 * 2**30))
    assert ("host RSS 31.6 GiB against 29.7 GiB planned (+6.4%); of that RSS, 0.75 GiB were mapped files, and "
            "malloc's free lists held 1.25 GiB (resident or not)") in _bound(row, None)
    within = dict(row, host_rss_bytes=31872670720)
    assert "mapped files" not in _bound(within, None)


def test_run9_reuses_run8s_baseline_and_says_so():
    runs = json.loads((RESULTS / "2026-11-29-h200-qwen2.5-7b-run9.json").read_text())
    base = [r for r in runs if r["system"] == "in-gpu-baseline"]
    assert base and all(r["commit"] == "59969c9" and "reused" in r["note"] for r in base)
    small = next(r for r in runs if r["system"] == "horizon-ray" and r["accum"] == 1)
    assert "against that step's plan, 113.5 GiB, it is -0.2%" in small["note"]


def test_the_row_group_size_reaches_horizon_ray_and_its_plan():
    """--layer-chunk (the job spec's layer_chunk_tokens) goes to horizon-ray's child and into its plan, whose GPU
    workspace grows with it; the peers, which run whole micro-batches, do not get it."""
    from horizon_ray.bench.planning import planned_bytes

    args = _args(shape="phi-3-mini", layer_chunk=16384, projections="split")
    hr = child_argv("horizon-ray", "phi-3-mini", args, "cuda", "bfloat16", "exact", "auto")
    assert hr[hr.index("--layer-chunk") + 1] == "16384"
    assert hr[hr.index("--projections") + 1] == "split"
    assert _mode_label({"system": "horizon-ray", "mode": "exact", "offload_checkpoints": "auto",
                        "offload_resolved": True, "layer_chunk_tokens": 16384, "projections": "split"}) == \
        "exact, ckpt host (auto), rows 16384, split GEMMs"
    assert "--layer-chunk" not in child_argv("in-gpu-liger", "phi-3-mini", args, "cuda", "bfloat16", None, None)
    shape = resolve_shape("phi-3-mini")
    gpu = {chunk: planned_bytes(shape, mode="exact", seq=1024, micro=16, accum=4, checkpoint_every=1,
                                dtype="bfloat16", device="cuda", gpu_budget_bytes=None, loss_chunk=2048,
                                offload="auto", layer_chunk=chunk)["planned_gpu_bytes"] for chunk in (8192, 16384)}
    assert gpu[16384] > gpu[8192] + 2**30  # twice the tokens in a layer's workspace (~2 GiB more at this width)


def test_a_gpu_row_on_torch_kernels_is_not_taken_for_the_fused_one():
    """A CUDA run whose box lacked Liger-Kernel ran unfused torch ops (0.66x on qwen3-4b): the tables keep it
    apart from the fused rows of the same settings, which it would otherwise replace as the newest."""
    fused = {"system": "horizon-ray", "mode": "exact", "offload_checkpoints": "auto", "offload_resolved": True,
             "layer_chunk_tokens": 16384, "projections": "split", "kernels": "liger"}
    assert _mode_label(fused) == "exact, ckpt host (auto), rows 16384, split GEMMs"
    assert _mode_label(dict(fused, kernels="torch")) == \
        "exact, ckpt host (auto), rows 16384, split GEMMs, torch kernels"
    text = (RESULTS.parent / "RESULTS.md").read_text()
    assert ("| h100 | qwen3-4b | exact, ckpt host (auto), rows 16384, split GEMMs | delayed | none | 1024 | 12.0 "
            "| 65,536 | 17,240 |") in text
