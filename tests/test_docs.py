"""The README agrees with docs/results.md: every number it quotes from that page is the page's number."""

import os
import re

import pytest
from conftest import ROOT, run_script


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return " ".join(f.read().split())  # one space between words, as a sentence reads


def results_rows():
    """Every table row of docs/results.md, by its first cell: the list of its cells."""
    rows = {}
    with open(os.path.join(ROOT, "docs", "results.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and not set(cells[1]) <= set("- "):
                rows.setdefault(cells[0], cells)  # the first table a name appears in: the summary table
    return rows


def start_end(cell):
    """'34.8 ± 0.0 → 69.6 ± 1.9' -> ('34.8', '69.6 ± 1.9'): the start's mean (every seed starts from the same
    model) and the end as the page gives it."""
    start, end = (part.strip() for part in cell.split("→"))
    return start.split(" ± ")[0], end


def minutes(seconds_cell):
    return f"{float(seconds_cell.split(' ± ')[0]) / 60:.1f}"


def test_the_readme_quotes_the_results_page():
    readme, rows = read("README.md"), results_rows()
    page = read("docs/results.md")
    runs, total = re.search(r"The (\d+) runs took (\d+) minutes", page).groups()
    assert f"its {runs} runs took {total} minutes, one after another" in readme
    start, end = start_end(rows["grpo"][1])
    assert (f"({rows['grpo'][4]} s of wall time over three seeds on this project's 2-core machine); held-out greedy"
            f" accuracy climbs from the bundled model's {start}% to {end}%") in readme
    real = []
    for name, label in (("grpo-smollm2", "GRPO"), ("rloo-smollm2", "RLOO"), ("dpo-smollm2", "DPO")):
        start, end = start_end(rows[name][1])
        real.append(f"{label} {start}% → {end}% in {minutes(rows[name][4])} min")
    best, peak = rows["grpo-smollm2"][2], float(rows["grpo-smollm2"][5])
    assert (f"{real[0]} of wall time (best {best}%, {peak:.1f} GB peak memory), {real[1]}, {real[2]}") in readme
    start, end = start_end(rows["ppo-learned-rm"][1])
    old_end = start_end(rows["ppo-learned-rm-one-pair"][1])[1]
    assert (f"raises held-out accuracy from {start}% to {end}% over three seeds, where the settings before took it"
            f" down to {old_end}%") in readme


def test_the_readme_quotes_the_bfloat16_comparison():
    readme, page = read("README.md"), read("docs/results.md")
    cells = {}
    for name in ("grpo-smollm2", "grpo-smollm2-bf16"):
        row = re.search(rf"\| {name} \| (float32|bfloat16) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|"
                        rf" (\d+) \| ([\d.]+) → ([\d.]+) \|", page)
        assert row, f"no {name} row in the bfloat16 section of docs/results.md"
        cells[name] = row.groups()
    f32, b16 = cells["grpo-smollm2"], cells["grpo-smollm2-bf16"]
    assert (f"{b16[1]} s a step against {f32[1]} s in float32, {b16[2]} GiB of peak memory against {f32[2]} GiB, and"
            f" held-out accuracy {b16[4]}% → {b16[5]}% against {f32[4]}% → {f32[5]}%") in readme


def test_the_readme_quotes_the_vllm_comparison():
    readme, page, rows = read("README.md"), read("docs/results.md"), results_rows()
    cells = {}
    for name in ("grpo", "grpo-vllm", "grpo-smollm2", "grpo-smollm2-vllm"):
        row = re.search(rf"\| {name} \| (generate\(\)|vLLM) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.e-]+|—) \|"
                        rf" ([\d ±]+) \| ([\d.]+)(?: ± [\d.]+)? → ([\d.± ]+?) \|", page)
        assert row, f"no {name} row in the vLLM section of docs/results.md"
        cells[name] = row.groups()
    hf, vl, hf2, vl2 = (cells[n] for n in ("grpo", "grpo-vllm", "grpo-smollm2", "grpo-smollm2-vllm"))
    assert (f"{vl[2]} s of generation a step against {hf[2]} s ({vl[3]} generated tokens/s against {hf[3]}), the"
            f" default run {vl[5]} s against {hf[5]} s") in readme
    assert f"held-out accuracy still climbs from {vl[6]}% to {vl[7]}% (`generate()`: {hf[7]}%)" in readme
    assert (f"generation takes {vl2[2]} s a step against {hf2[2]} s ({vl2[3]} generated tokens/s against {hf2[3]},"
            f" the weight copy included), a step {vl2[1]} s against {hf2[1]} s and the run {vl2[5]} s against"
            f" {hf2[5]} s, with {rows['grpo-smollm2-vllm'][5]} GiB of peak memory against"
            f" {rows['grpo-smollm2'][5]}") in readme
    assert (f"held-out accuracy {vl2[6]}% → {vl2[7]}% (one seed; `generate()`: {hf2[6]}% → {hf2[7]}%)."
            f" `rollout/logprob_diff` stays at {vl[4]} and {vl2[4]}") in readme


def test_the_readme_gives_the_memory_estimate_of_its_gpu_commands():
    """The README's table is what benchmarks/memory_estimate.py prints, and one row checks by hand: GRPO on
    Qwen2.5-0.5B keeps 16 bytes a parameter for the policy and 4 for the reference (float32, as the policy)."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import memory_estimate

    n = memory_estimate.parameters(memory_estimate.QWEN_05B)
    assert n == 494_032_768  # Qwen2.5-0.5B's parameters, its embedding tied to the output layer
    static, training, generation, peak = memory_estimate.estimate(memory_estimate.COMMANDS[0])
    assert static == pytest.approx(20 * n / 2**30)
    # micro-batches of 8 x 712 tokens with --gradient-checkpointing: the policy's bfloat16 weight copies, a float32
    # 896-vector a token for each of 24 layers plus one layer's 34 x 896 + 8 x 4864 + 4 x 14 heads + 8 + 2 x 712
    # bytes a token, and the output layer's backward: 5 chunks of 441 rows x 151,936 float32 logits (more than
    # 8 x 151,936 x 896 bytes of weight gradients)
    assert 5 * 441 * 151_936 * 4 > 8 * 151_936 * 896
    assert training == pytest.approx((2 * n + 8 * 712 * (24 * 4 * 896 + 34 * 896 + 8 * 4864 + 4 * 14 + 8 + 2 * 712)
                                      + 5 * 441 * 151_936 * 4) / 2**30)
    # 128 rollouts of 712 tokens: keys and values of 24 layers, 2 heads of 64, in float32; and two float32 rows of
    # 151,936 logits each
    assert generation == pytest.approx(128 * (2 * 24 * 2 * 64 * 712 * 4 + 2 * 151_936 * 4) / 2**30)
    assert peak == pytest.approx(static + max(training, generation))
    # the command the README gives prints the table, and the README gives it
    assert run_script("benchmarks/memory_estimate.py").stdout.strip() == memory_estimate.table()
    with open(os.path.join(ROOT, "README.md")) as f:
        assert memory_estimate.table() in f.read()


def test_the_readme_quotes_the_async_grpo_page():
    """The README's paragraph on async_grpo.py gives the numbers of docs/async_grpo.md's table (which
    benchmarks/async_benchmark.py writes): the lowest and highest final accuracy of the rows with eta > 0, grpo.py's,
    the runs' wall seconds at eta 0 and their range with eta > 0."""
    readme, rows = read("README.md"), {}
    with open(os.path.join(ROOT, "docs", "async_grpo.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 8 and not set(cells[1]) <= set("- "):
                rows[cells[0]] = cells
    ahead = [cells for name, cells in rows.items() if name.startswith("eta")]
    assert len(ahead) == 6 and {"grpo.py", "sync"} <= set(rows)
    ends = sorted((start_end(cells[1])[1] for cells in ahead), key=lambda end: float(end.split(" ± ")[0]))
    walls = sorted(int(cells[7].split(" ± ")[0]) for cells in ahead)
    quoted = [f"34.8% → {ends[0]}% to {ends[-1]}%", f"grpo.py {start_end(rows['grpo.py'][1])[1]}%",
              f"a run takes {walls[0]} to {walls[-1]} s against {rows['sync'][7].split(' ± ')[0]} s at η = 0",
              f"grpo.py: {rows['grpo.py'][7]} s"]
    for text in quoted:
        assert text in readme, text
