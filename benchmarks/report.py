"""docs/performance.md from the result records in benchmarks/records/: the current figure of each measurement.

    python benchmarks/report.py                 # writes docs/performance.md
    python benchmarks/report.py --out FILE      # writes FILE instead

One table per area. A measurement is a tool, a recipe, its overrides, the hardware and the kernel packages
installed; each row of a measurement comes from its newest record that has that row (a tool that measures
several things may measure them in separate calls), and a record with `superseded_by` set is left out. The
conclusions of finished experiments (their scripts and records live in git history) are kept here, in FINISHED.
tests/test_bench_records.py checks that docs/performance.md is what this script writes.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import common

DOC = common.REPO / "docs" / "performance.md"
LINK = "../benchmarks/records/"   # from docs/ to the records

AREAS = ["Single-GPU speed against peers", "Multi-GPU scaling", "Sharded training", "Mixture of Experts", "Speedrun",
         "Fine-tuning", "T5", "Evaluation", "Quality parity", "Hardware rates", "CPU"]

# (what, conclusion, where it was measured: a record kept in benchmarks/records/, or the commits that hold it)
FINISHED = [
    ("attention_speed.py", "FlashAttention-4's variable-length kernels run one 64K-token speedrun attention layer "
     "forward and backward in 1.81 ms against 2.82 ms for compiled FlexAttention with 128-token window blocks "
     "(window 1,792, H100), so `model.attention=auto` takes FlashAttention-4 wherever flash-attn-4 is installed.",
     "acd29fe"),
    ("fused_norm_configs.py", "Of 20 forward and 48 backward launch configurations of the fused add+LayerNorm "
     "kernels at gpt2-125m's 49,152 x 768, the fastest (0.151 and 0.220 ms on an H200, 3.0 and 2.7 TB/s where a "
     "copy of x runs at 3.7) are 4K elements over 2 warps per forward program and 2K over 4 warps per backward "
     "program, which `model.fused_norm` uses.", "bb0d7a0"),
    ("model.fused_norm", "Each residual add and the LayerNorm after it as one op with a one-pass backward took "
     "gpt2-125m's step from 949.7 to 930.6 ms on an H100 and from 917.9 to 909.3 ms on an H200 (SDPA attention, "
     "same call).", "bb0d7a0"),
    ("gemm_gelu_epilogue.py", "Triton GEMMs with the tanh-GELU (or its derivative) in their epilogue lost to "
     "cuBLAS and a separate GELU kernel at gpt2-125m's MLP shape on an H100 (forward 0.748 against 0.525 ms, "
     "backward 0.929 against 0.651 ms), so `model.fused_mlp` uses QuACK's epilogue GEMMs instead.",
     "bb0d7a0"),
    ("model.fused_mlp", "The MLP's GELU and its derivative in QuACK's GEMM epilogues took gpt2-125m's step from "
     "900.3 to 866.0 ms at micro-batch 48 on an H100 (FlashAttention-4, same call), and the experts' six matmuls "
     "on QuACK's variable-length grouped GEMMs took moe-gpt2-125m's from 1,457.4 to 1,307.2 ms.",
     "d7ef6ac adc5bb5"),
    ("fused_mlp_kernels.py", "Alone, QuACK's GEMM tilings rank otherwise than inside the training step (256 x 160 "
     "cooperative fastest alone, 128 x 192 ping-pong in the step, H100), so `model.fused_mlp`'s tiling was chosen "
     "by step time.", "d7ef6ac"),
    ("grouped_mm_layouts.py", "torch's grouped GEMM runs moe-gpt2-125m's expert matmuls at 545-640 TFLOP/s where "
     "a dense matmul of the same FLOPs reaches 680-725 (H100); the weights' (experts, in, out) layout is the "
     "faster for the forward and input gradient together, and Inductor's Triton grouped template is no faster.",
     "b228e24"),
    ("FP8 experts", "FP8 expert matmuls (grouped e4m3 GEMMs with per-row scales) made moe-gpt2-125m's step slower "
     "on an H100 (1,435.9 ms with model.fp8_mlp=both, 1,446.6 with down, against 1,412.7 in bf16, same call): the "
     "quantisation kernels cost more than the matmuls saved, so the experts run in bf16.", "7199d6b"),
    ("model.fused_loss head", "QuACK's linear cross-entropy for the loss head took gpt2-125m's step from 846.0 to "
     "810.0 ms and its peak memory from 52.4 to 41.9 GiB against trainbox's Triton head kernel (H100, same call).",
     "aca80fc"),
    ("numerics of gpt2-125m", "After 200 steps (seed 1337, H100) a bf16 residual stream cost +0.052 validation "
     "loss and the FP8 head +0.073 (both +0.111) for steps of 896, 873 and 826 ms against 933 ms, so the gpt2 "
     "recipes keep nanoGPT's numerics (fp32 residual stream, bf16 head).",
     "ac1248d"),
    ("init_parity.py", "At initialisation gpt2-125m is nanoGPT's model: nanoGPT's weights in ours give its loss to "
     "1e-5 (the GELU's tanh form), and 16 draws of each side's initialisation give mean losses 0.010 apart (95% "
     "interval -0.159 to 0.180; CPU).", "4684d78"),
    ("model.moe.overlap (not kept)", "Each rank running its own experts' rows while the other rank's are exchanged "
     "hid the 128-expert model's exchange on 2 H200s at H100 memory (exposed communication 52.6 against 177.1 ms a "
     "step, GPU idle 79.4 against 200.0), but its grouped matmuls, split in two, took 415.1 against 331.8 ms and "
     "the two halves' weight gradients another 40 ms to sum: the settled step ran 7-10% slower in two pairs, so "
     "the branch moe-exchange-overlap was not merged.",
     "2026-12-01-2xh200-moe-gpt2-125m-128x-ep2-overlap-vs-plain-h100mem.json"),
    ("Inductor's GEMM templates (train_speed.py --templates)", "Autotuning only the experts' grouped "
     "matmuls over Inductor's Triton template took moe-gpt2-125m's step from 1,417 to 1,797 ms on an H200 (the GELU "
     "and its derivative fused into the templates ran 1.9 and 4.4 ms a call), and only the MLP's matmuls gpt2-125m's "
     "from 879.5 to 905.0 ms (the templates 15-25% behind cuBLAS at its shapes), same process, plain install, so "
     "neither model runs them.", "2026-12-01-h200-moe-gpt2-125m-triton-grouped-templates.json"),
    ("learning-rate warm-up", "A warm-up of lr (s+1)/W, 5% above nanoGPT's (s+1)/(W+1) over 20 steps, ended 0.097 "
     "and 0.165 above nanoGPT after 200 steps on one of two seeds (H200), so the loop's warm-up is nanoGPT's.",
     "2026-11-27-2xh200-gpt2-125m-step-parity-warmup.json"),
]


# ----------------------------------------------------------------------------------------------- formatting

def kilo(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:,.2f}M"
    return f"{v / 1e3:.1f}k" if v < 1e5 else f"{v / 1e3:,.0f}k"


def ms(v: float) -> str:
    return f"{v:,.1f} ms"


def gib(v: float | None) -> str:
    return f"{v:.1f} GiB" if v is not None else "memory not measured"


def speed(m: dict, tokens_key: str = "tokens_per_s", ms_key: str = "median_step_ms") -> str:
    parts = [f"{kilo(m[tokens_key])} tokens/s"]
    if m.get(ms_key):
        parts[0] += f" ({ms(m[ms_key])}/step)"
    if m.get("mfu"):
        parts.append(f"{m['mfu']:.1%} MFU")
    if m.get("peak_mem_gib") is not None:
        parts.append(gib(m["peak_mem_gib"]))
    if m.get("peak_reserved_gib") is not None:
        parts[-1] += f" ({gib(m['peak_reserved_gib'])} reserved)"
    return ", ".join(parts)


# ----------------------------------------------------------------------------------------------- rows per tool
# each returns [(label suffix, ours, baseline, ratio)]

def saves(m: dict) -> str:
    """What each checkpoint added to the step time around it, where the run saved."""
    added = m.get("save_block_ms") or {}
    if not added:
        return ""
    which = "the save at step " if len(added) == 1 else "the saves at steps "
    return f", {which}{', '.join(added)} added {', '.join(f'{v:,.0f}' for v in added.values())} ms"


def stood(m: dict) -> str:
    """Where a run records every step's time: the first step, and the time the later ones took beyond their
    median (what pinning, a save or anything else outside the step cost training)."""
    steps = m.get("step_s")
    if not steps:
        return ""
    over = max(0.0, sum(steps) - len(steps) * statistics.median(steps))
    return (f", first step {m['first_step_s']:.1f} s, steps 2-{len(steps) + 1} {sum(steps):.1f} s ({over:.1f} s "
            f"over their median)")


def routing(m: dict) -> str:
    """An MoE run with a capacity: its settled steps (train_speed's `settled`), or where it has none, how much its
    router dropped over the run: expert parallelism computes only the kept assignments, so a dropping phase runs
    faster than the run will."""
    if m.get("settled_median_step_ms"):
        mfu = f", {m['settled_mfu']:.1%} MFU" if m.get("settled_mfu") else ""
        return (f", settled (the router dropping at most 10%): {ms(m['settled_median_step_ms'])}/step{mfu} over "
                f"{m['settled_steps']} steps")
    drops = m.get("moe_dropped_frac")
    if drops and max(drops) > 0.10:
        return f", the router dropping {min(drops):.0%}-{max(drops):.0%} of the assignments (not settled)"
    return ""


def train_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    ours = (speed(m) + routing(m) + (f", val loss {m['val_loss']:.3f}" if m.get("val_loss") else "") + saves(m)
            + stood(m))
    if not b:
        return [("", ours, "—", "—")]
    bm = b["metrics"]
    base = f"{b['name']}: {ms(bm['median_step_ms'])}/step" + (
        f", {gib(bm['peak_memory_reserved_gib'])} reserved" if bm.get("peak_memory_reserved_gib") else "")
    base += saves(bm) + stood(bm)
    if "per_gpu_vs_baseline" in m:   # another model on another GPU count: tokens/s per GPU against its
        ratio = f"{m['per_gpu_vs_baseline']:.2f}x its tokens/s per GPU"
    elif bm.get("recipe") and bm["recipe"] != rec["recipe"]:
        ratio = f"{m['median_step_ms'] / bm['median_step_ms']:.2f}x the {bm['recipe']} step time"
    else:
        ratio = f"{bm['median_step_ms'] / m['median_step_ms']:.2f}x"
    return [("", ours, base, ratio)]


def profile_step(rec: dict) -> list[tuple]:
    return [("", speed(rec["metrics"], ms_key="step_ms"), "—", "—")]


def time_to_loss(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    ours = f"val loss {m['val_loss']:.4f} after {m['train_time_s']:.1f} s ({m['steps']} steps)"
    if not b:
        return [("", ours, "—", "—")]
    bm = b["metrics"]
    base = f"{b['name']}: {bm['val_loss']:.4f} after {bm['train_time_s']:.1f} s ({bm['steps']} steps)"
    return [("", ours, base, f"{m['val_loss'] - bm['val_loss']:+.4f} val loss")]


def compile_cache(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    key = "launch_to_first_step_s" if "launch_to_first_step_s" in m["second"] else "first_step_s"
    first, second = m["first"], m["second"]
    ours = f"second start: first step done {second[key]:.1f} s after launch (compiling {second['compile_s']:.1f} s)"
    base = f"cold start: {first[key]:.1f} s (compiling {first['compile_s']:.1f} s)"
    return [("", ours, base, f"{first[key] / second[key]:.1f}x faster start")]


def monitor_overhead(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    modes = list(m["median_step_ms"])
    key = next(k for k in m if k.startswith("overhead_pct_vs_"))
    rows = []
    for mode in modes[1:]:
        ours = f"{ms(m['median_step_ms'][mode])}/step, monitor {mode} (a client every {m['poll_ms']:.0f} ms)"
        base = f"monitor {modes[0]}: {ms(m['median_step_ms'][modes[0]])}/step"
        rows.append((f" ({mode})" if len(modes) > 2 else "", ours, base, f"{m[key][mode]:+.2f}% step time"))
    return rows


def ddp_check(rec: dict) -> list[tuple]:
    w = rec["metrics"]["world_size_invariance"]
    ours = f"{kilo(w['tokens_per_s_2gpu'])} tokens/s on 2 GPUs ({ms(w['step_time_s_2gpu'] * 1e3)}/step)"
    base = f"1 GPU, same global batch: {kilo(w['tokens_per_s_1gpu'])} ({ms(w['step_time_s_1gpu'] * 1e3)}/step)"
    ratio = f"{w['speedup_2gpu']:.2f}x; per-step losses within {w['max_abs_diff']:.3f} of 1 GPU's"
    return [("", ours, base, ratio)]


def lora_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    rows = []
    for mode in ("lora", "qlora"):
        if not (m.get(mode) and b and b["metrics"].get(mode)) or "error" in m[mode] or "error" in b["metrics"][mode]:
            continue   # a side that did not run (the record keeps its error)
        o, t = m[mode], b["metrics"][mode]
        rows.append((f" ({'LoRA' if mode == 'lora' else 'QLoRA'})",
                     f"{kilo(o['tokens_per_s'])} tokens/s, {gib(o['peak_memory_gib'])}",
                     f"{b['name']}: {kilo(t['tokens_per_s'])} tokens/s, {gib(t['peak_memory_gib'])}",
                     f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x"))
    return rows


def packing_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    ours = (f"packed: {kilo(m['tokens_per_s'])} tokens/s ({m['fill']:.0%} of positions filled), "
            f"held-out loss per example {m['loss_per_example']:.3f}")
    if not (b and b["metrics"].get("tokens_per_s")):
        return [("", ours, "—", "—")]
    bm = b["metrics"]
    base = (f"{b['name']}: {kilo(bm['tokens_per_s'])} tokens/s ({bm['fill']:.0%} filled), "
            f"loss per example {bm['loss_per_example']:.3f}")
    return [("", ours, base, f"{m['speedup']:.2f}x; loss per example {m['loss_per_example_rel_diff']:+.1%}")]


def t5_speed(rec: dict) -> list[tuple]:
    o, b = rec["metrics"]["results"][0], rec["baseline"]
    ours = (f"{kilo(o['tokens_per_s'])} tokens/s, {o['mfu']:.1%} MFU, "
            f"{gib(o.get('max_memory_allocated_gib'))}")
    if not b:
        return [("", ours, "—", "—")]
    t = b["metrics"]
    base = f"{b['name']}: {kilo(t['tokens_per_s'])} tokens/s, {gib(t.get('max_memory_allocated_gib'))}"
    return [("", ours, base, f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x")]


def step_parity(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    runs = m["runs"]
    nano = {r["seed"]: r for r in runs if r["arm"] == "nanogpt"}
    rows = []
    for arm in m["arms"]:
        if arm == "nanogpt":
            continue
        mine = [r for r in runs if r["arm"] == arm and r["seed"] in nano]
        paired = m["summary"].get("val_minus_nanogpt", {}).get(arm)
        if paired:
            ours = (f"{arm}: val loss {statistics.mean(r['val_loss'] for r in mine):.4f} after {m['steps']} steps, "
                    f"{paired['n']} seeds")
            base = f"nanoGPT, same seeds: {statistics.mean(nano[r['seed']]['val_loss'] for r in mine):.4f}"
            ratio = f"paired difference {paired['mean']:+.4f}"
            if "interval_95" in paired:
                lo, hi = paired["interval_95"]
                ratio += f" (95% interval {lo:+.3f} to {hi:+.3f}): {paired['verdict']}"
        else:
            diffs = [[abs(a - b) for a, b in zip(r["losses"], nano[r["seed"]]["losses"])] for r in mine]
            ours = (f"{arm}: training loss within {max(max(d[:6]) for d in diffs):.4f} of nanoGPT's over steps 0-5, "
                    f"{max(max(d) for d in diffs):.4f} over {m['steps']} steps ({len(mine)} seeds)")
            base = "nanoGPT from the same weights on the same batches"
            ratio = "—"
        rows.append((f" ({arm})", ours, base, ratio))
    return rows


def loss_parity(rec: dict) -> list[tuple]:
    c = rec["metrics"].get("comparison")
    if not c:
        return [("", f"{len(rec['metrics']['runs'])} runs", "—", "—")]
    lo, hi = c["interval_95"]
    return [("", f"val loss {c['mean']['ours']:.4f} (stdev {c['stdev']['ours']:.3f})",
             f"nanoGPT: {c['mean']['nanogpt']:.4f} (stdev {c['stdev']['nanogpt']:.3f})",
             f"{c['difference']:+.4f} (95% interval {lo:+.3f} to {hi:+.3f}): {c['verdict']}")]


def prepare_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    ours = (f"{kilo(m['prepare_2_workers_tokens_per_s'])} tokens/s with 2 workers "
            f"({kilo(m['prepare_1_worker_tokens_per_s'])} with 1)")
    base = f"{b['name']}: {kilo(b['metrics']['tokens_per_s'])} tokens/s" if b else "—"
    return [("", ours, base, f"{m['ratio_2_workers_vs_plain']:.2f}x with 2 workers")]


def make_corpus(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]

    def streams(s: dict) -> str:
        return (f"train {s['train_tokens']:,} tokens (sha256 {s['sha256_train'][:12]}), "
                f"val {s['val_tokens']:,} ({s['sha256_val'][:12]})")
    if not b:
        return [("", streams(m), "—", "—")]
    return [("", streams(m), f"{b['name']}: {streams(b['metrics'])}",
             "identical streams" if m["identical_streams"] else "the streams differ")]


def trainbox_train(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    ours = f"{m['wall_s']:.1f} s, {m['val_bits_per_byte']:.4f} bits per byte"
    if not b:
        return [("", ours, "—", "—")]
    bm = b["metrics"]
    return [("", ours, f"{b['name']}: {bm['wall_s']:.1f} s, {bm['val_bits_per_byte']:.4f} bits per byte",
             f"{bm['wall_s'] / m['wall_s']:.2f}x")]


def resume_check(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    ours = (f"resumed from step {m['cut']} on {m['resume_nproc']} GPU(s): loss within {m['max_abs_diff']:.4f} "
            f"(mean {m['mean_abs_diff']:.5f}) over {m['steps_compared']} steps")
    base = (f"the uninterrupted run on {m['nproc']} GPU(s); its loss moves {m['step_to_step_change']:.3f} a step")
    return [("", ours, base, "—")]


def eval_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]["metrics"]
    ours = f"{m['docs_per_s']:,.1f} documents/s ({m['dtype']}, batch {m['batch_size']}, acc {m['acc']:.3f})"
    base = f"lm-eval's hf model: {b['docs_per_s']:,.1f} documents/s (acc {b['acc']:.3f})"
    return [("", ours, base, f"{m['speedup_vs_lm_eval_hf']:.2f}x")]


def eval_tasks_overhead(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    ours = (f"{ms(m['median_step_ms']['tasks'])}/step with lm-eval tasks every {m['every']} steps "
            f"({ms(m['median_step_ms_right_after_an_evaluation'])} right after one; the evaluations, "
            f"{m['evaluation_seconds']['median']:.1f} s each, left out)")
    base = f"no tasks: {ms(m['median_step_ms']['off'])}/step"
    return [("", ours, base, f"{m['overhead_pct_median']:+.2f}% step time ({m['overhead_pct_median_cpu']:+.2f}% "
             "CPU time)")]


def dpo_real_run(rec: dict) -> list[tuple]:
    d = rec["metrics"]["dpo"]
    val = d["val"][-1] if d["val"] else {}
    beta = d["beta"]
    first = (f"{d['reward_accuracy_first']:.2f} at step 1 (the policy is the reference)"
             if "reward_accuracy_first" in d else f"{d['reward_accuracy_start']:.2f}")
    ours = (f"reward accuracy {first} -> {d['reward_accuracy_end']:.2f} over the last 10 steps (validation "
            f"{val.get('reward_accuracy', float('nan')):.2f})")
    if "reward_chosen_end" in d:   # the chosen responses' log-probability against the initial model's, same pairs
        ours += (f", chosen log-probability {d['reward_chosen_end'] / beta:+.2f} nats against the SFT model's "
                 f"(validation {val.get('reward_chosen', float('nan')) / beta:+.2f})")
    ours += f" over {d['steps']} steps"
    figure = rec["metrics"].get("loss_png", {}).get("dpo", "")
    if figure.startswith("docs/"):
        ours += f" ([loss.png]({figure[len('docs/'):]}))"
    return [("", ours, f"SFT {rec['metrics']['sft']['steps']} steps: loss {rec['metrics']['sft']['final_loss']:.2f}",
             "—")]


def dpo_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    rows = []
    for mode in ("full", "full-ref", "full-packed", "lora"):
        o, t = m.get(mode), (b["metrics"].get(mode) if b else None)
        if not (o and t and o.get("tokens_per_s") and t.get("tokens_per_s")):
            continue
        plan = f" (plan {gib(o['plan_peak_gib'])})" if o.get("plan_peak_gib") else ""
        if m.get("variable"):   # pairs of varied lengths: pairs/s, the padding each side adds left out
            rows.append((f" ({mode}, pairs of varied lengths)",
                         f"{o['pairs_per_s']:.1f} pairs/s ({kilo(o['real_tokens_per_s'])} of their tokens/s), "
                         f"{gib(o['peak_memory_gib'])}{plan}",
                         f"{b['name']}: {t['pairs_per_s']:.1f} pairs/s, {gib(t['peak_memory_gib'])}",
                         f"{o['pairs_per_s'] / t['pairs_per_s']:.2f}x"))
            continue
        rows.append((f" ({mode})", f"{kilo(o['tokens_per_s'])} tokens/s, {gib(o['peak_memory_gib'])}{plan}",
                     f"{b['name']}: {kilo(t['tokens_per_s'])} tokens/s, {gib(t['peak_memory_gib'])}",
                     f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x"))
    if m.get("longest_ours") is not None or (b and b["metrics"].get("longest") is not None):
        rows.append((" (longest sequence, full DPO of 1B, one GPU)", f"{m.get('longest_ours')} tokens",
                     f"{b['name']}: {b['metrics'].get('longest')} tokens", "—"))
    return rows


def grpo_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]
    rows = []
    for mode in ("full", "lora", "qlora"):
        o, t = m.get(mode), (b["metrics"].get(mode) if b else None)
        if not (o and t and o.get("step_s") and t.get("step_s")):
            continue
        sampled = f" ({o['sample_s']:.1f} s sampling)" if o.get("sample_s") else ""
        rows.append((f" ({mode}, {m['prompts']} prompts x {m['generations']} completions of {m['completion_len']} a "
                     "step)", f"{o['step_s']:.2f} s/step{sampled}, {kilo(o['completion_tokens_per_s'])} completion "
                     f"tokens/s, {gib(o['peak_memory_gib'])}",
                     f"{b['name']}: {t['step_s']:.2f} s/step, {kilo(t['completion_tokens_per_s'])} completion "
                     f"tokens/s, {gib(t['peak_memory_gib'])}", f"{t['step_s'] / o['step_s']:.2f}x"))
    return rows


def batch_invariance(rec: dict) -> list[tuple]:
    m, s = rec["metrics"], rec["metrics"]["summary"]

    def drift(arms: list[str]) -> str:   # the step-1 gradient (relative), the weights after steps 1, 20 and the last
        shown = [i for i, step in enumerate(m["weight_steps"]) if step in (1, 20, m["steps"])]
        return (f"gradient {max(s[a]['grad1_rel_norm'] for a in arms):.1e}, weights " +
                ", ".join(f"{max(m['arms'][a]['weight_max_abs_diff'][i] for a in arms):.1e} after "
                          f"{'step ' if i == 0 else ''}{m['weight_steps'][i]}" for i in shown))

    runs = [a for a in ("ddp-2", "ddp-4", "fsdp-2", "fsdp-4") if a in s]
    ours = (f"{m['dtype']}, {', '.join(runs)} against 1 process: {drift(runs)} (losses "
            f"{max(s[a]['loss_max'] for a in runs):.2g})") if runs else "—"
    controls = [f"{label}: {drift(arms)}" for arms, label in (
        (["order"], "1 process summing in reverse order"),
        ([a for a in ("fp64-ddp-2", "fp64-fsdp-2") if a in s], "2 processes in float64"),
        (["sgd-fsdp-2"], "fsdp-2 with SGD"), (["defect-sample"], "one wrong sample a step"))
        if all(a in s for a in arms) and arms]
    return [("", ours, "; ".join(controls) or "—", "—")]


def hw_rates(rec: dict) -> list[tuple]:
    """What plan/gpus.py's Rates take from the record (benchmarks/hw_rates.py)."""
    r = rec["metrics"]["rates"]
    parts = [f"bf16 matmul {r['matmul'] / 1e12:.0f} TFLOP/s", f"AdamW {r['memory'] / 1e12:.2f} TB/s",
             f"host read {r['host_sync'] * 1e6:.0f} us"]
    if "all_reduce" in r:
        parts[1:1] = [f"all-reduce {r['all_reduce'] / 1e9:.0f} GB/s, all-to-all {r['all_to_all'] / 1e9:.0f} GB/s (bus)"]
    return [("", ", ".join(parts), "—", "—")]


def biased_attention(rec: dict) -> list[tuple]:
    rows = []
    for name, row in rec["metrics"]["shapes"].items():
        ours, sdpa = row["trainbox triton"], row["sdpa efficient (bias as a mask)"]
        rows.append((f" ({name})", f"{name}: {ours['ms']:.3f} ms forward + backward, {ours['tflops']:.0f} TFLOP/s",
                     f"SDPA memory-efficient, the bias as a mask: {sdpa['ms']:.3f} ms", f"{row['speedup']:.2f}x"))
    return rows


def megablocks_speed(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    return [(f" ({m['experts']} experts)",
             f"{m['experts']} experts, top-{m['top_k']}, {m['tokens']:,} tokens: {m['ms_compiled']:.2f} ms forward + "
             f"backward compiled ({m['expert_tflops_compiled']:.0f} TFLOP/s in the experts), {m['ms_eager']:.2f} ms "
             f"eager, {gib(m['peak_gib_compiled'])}",
             f"{rec['baseline']['name']}: {m['ms_megablocks']:.2f} ms, {gib(m['peak_gib_megablocks'])}",
             f"{m['speedup_compiled_vs_megablocks']:.2f}x")]


def pin_speed(rec: dict) -> list[tuple]:
    m, b = rec["metrics"], rec["baseline"]["metrics"]

    def lost(x):   # what a GPU loop beside the pinning lost, where the record measured it
        return f", a GPU loop beside it lost up to {x['loop_s_lost_max']:.1f} s" if "loop_s_lost_max" in x else ""

    return [("", f"one rank's shard of {m['world']}-way FSDP ({m['shard_gib']:.1f} GiB), {m['procs']} processes at "
                 f"once: pinned in {m['pin_s_median']:.1f} s, {gib(m['pinned_gib'])} pinned, staged in "
                 f"{m['stage_s_median']:.2f} s{lost(m)}",
             f"{rec['baseline']['name']}: {b['pin_s_median']:.1f} s, {gib(b['pinned_gib'])} pinned{lost(b)}",
             f"{m['speedup']:.2f}x")]


def grouped_mm_rates(rec: dict) -> list[tuple]:
    m = rec["metrics"]
    aten, best = m["per_layer_ms"]["aten"], m["per_layer_ms"]["fastest_each"]
    dw = ", ".join(f"{lin} {v['aten_dw_tflops']:.0f}" for lin, v in m.items()
                   if isinstance(v, dict) and "aten_dw_tflops" in v)
    return [(f" ({m['experts']} experts)",
             f"{m['experts']} experts, {m['rows']:,} rows: one layer's six grouped matmuls {aten:.3f} ms in ATen's "
             f"kernel, {best:.3f} ms with the fastest kernel for each; ATen's weight gradients at {dw} TFLOP/s",
             "the fastest of ATen, Inductor's Triton template and a cuBLAS loop, for each matmul",
             f"ATen's kernel takes {aten / best:.2f}x the time")]


def generic(rec: dict) -> list[tuple]:
    scalars = [f"{k} {v}" for k, v in rec["metrics"].items() if isinstance(v, (int, float, str))][:4]
    return [("", ", ".join(scalars) or "—", rec["baseline"]["name"] if rec["baseline"] else "—", "—")]


ROWS = {"train_speed": train_speed, "profile_step": profile_step, "time_to_loss": time_to_loss,
        "compile_cache": compile_cache, "monitor_overhead": monitor_overhead, "ddp_check": ddp_check,
        "lora_speed": lora_speed, "packing_speed": packing_speed, "t5_speed": t5_speed, "step_parity": step_parity,
        "loss_parity": loss_parity,
        "prepare_speed": prepare_speed, "make_corpus": make_corpus, "trainbox-train": trainbox_train,
        "tiny_default_run": trainbox_train,
        "resume_check": resume_check, "batch_invariance": batch_invariance, "eval_speed": eval_speed,
        "eval_tasks_overhead": eval_tasks_overhead, "dpo_real_run": dpo_real_run, "dpo_speed": dpo_speed,
        "grpo_speed": grpo_speed,
        "hw_rates": hw_rates, "biased_attention": biased_attention, "megablocks_speed": megablocks_speed,
        "pin_speed": pin_speed, "grouped_mm_rates": grouped_mm_rates}


# ----------------------------------------------------------------------------------------------- the page

def area(rec: dict) -> str:
    recipe = rec["recipe"] or ""
    if rec["tool"] == "hw_rates":
        return "Hardware rates"
    if rec["tool"] in ("step_parity", "loss_parity"):
        return "Quality parity"
    if rec["tool"] == "eval_speed" and rec["gpu"] is not None:
        return "Evaluation"
    if rec["tool"] == "ddp_check" or (rec["tool"] == "batch_invariance" and rec["gpu"]):
        return "Multi-GPU scaling"
    if "train.parallel=fsdp" in (rec.get("overrides") or []) or recipe.startswith("llama"):
        return "Sharded training"
    if rec["tool"] == "train_speed" and (rec["metrics"].get("nproc") or 1) > 1 and not recipe.startswith("moe"):
        return "Multi-GPU scaling"
    if rec["gpu"] is None:
        return "CPU"
    if rec["tool"] in ("lora_speed", "packing_speed", "dpo_speed", "grpo_speed"):
        return "Fine-tuning"
    if rec["tool"] in ("t5_speed", "biased_attention") or recipe.startswith("t5"):
        return "T5"
    if recipe.startswith("moe") or rec["tool"] in ("megablocks_speed", "grouped_mm_rates"):
        return "Mixture of Experts"
    if recipe.startswith("speedrun"):
        return "Speedrun"
    return "Single-GPU speed against peers"


def measurement(rec: dict) -> tuple:
    """What a record measures: two records with the same key measure the same thing (against the same
    baseline: a run against an older commit is not the same measurement as one against nanoGPT)."""
    return (rec["tool"], rec["recipe"], tuple(rec["overrides"]), common.hardware(rec["gpu"]),
            tuple(sorted((k, v) for k, v in rec["software"].items() if k in common.KERNEL_PACKAGES)),
            (rec["baseline"] or {}).get("name"))


def recency(pr: tuple[Path, dict]) -> tuple:
    """Later records sort higher: by date, then a file name's count (NAME.json, NAME-2.json, NAME-3.json ...)."""
    path, rec = pr
    stem, _, count = path.stem.rpartition("-")
    return (rec["date"], stem, int(count)) if count.isdigit() and len(count) < 4 else (rec["date"], path.stem, 1)


def current(records: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """Records that are not superseded, newest first within a measurement, measurements by file name."""
    live = sorted(((p, r) for p, r in records if not r["superseded_by"]), key=recency, reverse=True)
    first = {}
    for path, rec in live:
        first.setdefault(measurement(rec), path.name)
    return sorted(live, key=lambda pr: first[measurement(pr[1])])


def newest_rows(shown: list[tuple[Path, dict]]):
    """(path, record, row) for each row of a measurement, from the newest record that has that row: a tool that
    measures several things in one call (dpo_speed: each mode, and the longest sequence) may run them apart, and
    an older record's row stays until a newer record of the same measurement has it."""
    seen = set()
    for path, rec in shown:
        for row in ROWS.get(rec["tool"], generic)(rec):
            key = (measurement(rec), row[0])
            if key not in seen:
                seen.add(key)
                yield path, rec, row


def gpu_text(gpu: dict | None) -> str:
    if gpu is None:
        return "CPU"
    return f"{gpu['count']}x {gpu['name']}" if gpu["count"] > 1 else gpu["name"]


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(records: list[tuple[Path, dict]]) -> str:
    shown = current(records)
    out = ["# Performance", "",
           "Generated by `python benchmarks/report.py` from the result records in `benchmarks/records/`; do not "
           "edit by hand. Each row is the newest record of one measurement (tool, recipe, overrides, hardware and "
           "kernel packages) that has that row; the record holds its command, commit, software and every figure "
           "the tool printed, and `benchmarks/README.md` lists the tools. Ratios are the baseline's step time over "
           "ours (our speed relative to the baseline) unless the row says otherwise.", ""]
    for name in AREAS:
        rows = []
        for path, rec, (suffix, ours, base, ratio) in newest_rows(shown):
            if area(rec) != name:
                continue
            what = f"`{rec['what']}`{suffix}, {rec['tool']}"
            rows.append(f"| {cell(what)} | {cell(ours)} | {cell(base)} | {cell(ratio)} | {gpu_text(rec['gpu'])} "
                        f"| [{path.name}]({LINK}{path.name}) |")
        if not rows:
            continue
        out += [f"## {name}", "", "| what | ours | baseline | ratio | GPU | record |", "|---|---|---|---|---|---|",
                *rows, ""]
    out += ["## Finished experiments", "",
            "Experiments whose outcome is now part of the code; their scripts and records are in git history.", ""]
    for what, conclusion, source in FINISHED:
        where = f"[{source}]({LINK}{source})" if source.endswith(".json") else f"`git show {source}`"
        out.append(f"- **{what}**: {conclusion} ({where})")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DOC, help="the page to write (default: docs/performance.md)")
    ap.add_argument("--records", type=Path, default=common.RECORDS, help="the folder of records")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(common.load_records(args.records)))


if __name__ == "__main__":
    main()
