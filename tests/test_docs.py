"""The README and the docs pages agree with the pages that measured their numbers, and every link resolves.

Each number a page quotes from another is read from that page's table here, so a re-run benchmark that changes
the table fails these tests until the quotes follow it."""

import glob
import os
import re
import unicodedata

import pytest
from conftest import ROOT, run_script

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def raw(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def read(path):
    return " ".join(raw(path).split())  # one space between words, as a sentence reads


def table_rows(path, columns=None):
    """Every table row of a page by its first cell: the list of its cells (the first table a name appears in)."""
    rows = {}
    for line in raw(path).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 1 and not set(cells[1]) <= set("- :"):
            if columns is None or len(cells) == columns:
                rows.setdefault(cells[0], cells)
    return rows


def start_end(cell):
    """'34.8 ± 0.0 → 69.6 ± 1.9' -> ('34.8', '69.6 ± 1.9'): the start's mean (every seed starts from the same
    model) and the end as the page gives it."""
    start, end = (part.strip() for part in cell.split("→"))
    return start.split(" ± ")[0], end


def results():
    return table_rows("docs/results.md")


def test_the_readme_quotes_the_results_page():
    readme, page = read("README.md"), read("docs/results.md")
    runs, total = re.search(r"The (\d+) runs took (\d+) minutes", page).groups()
    assert f"its {runs} runs took {total} minutes, one after another" in readme
    # SmolLM2's three seeds: the DAPO section's GRPO row
    dapo = raw("docs/results.md").split("## DAPO against GRPO")[1].split("\n## ")[0]
    cells = [c.strip() for c in re.search(r"^\| grpo-smollm2 \|.*$", dapo, flags=re.M).group(0).strip("|").split("|")]
    start, end = start_end(cells[1])
    assert f"{start}% → {end}% on 100 held-out questions in {cells[3]} s, three seeds" in readme


def test_the_readmes_first_line_quotes_the_tests_page():
    """The set-up's numbers (the plain grpo.py's default run) are the mean and standard deviation of the seeds that
    docs/tests.md tabulates under "The README's first line", and its range of whole-process seconds."""
    import statistics

    section = raw("docs/tests.md").split("## The README's first line")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (\d) \| ([\d.]+)% → ([\d.]+)% \| ([\d.]+) s", section, flags=re.M)
    assert len(rows) == 3
    start = {r[1] for r in rows}
    ends, seconds = [float(r[2]) for r in rows], [float(r[3]) for r in rows]
    mean, std = statistics.mean(ends), statistics.stdev(ends)
    assert len(start) == 1 and f"from {start.pop()}% to {mean:.1f} ± {std:.1f}% in" in read("README.md")
    assert f"the whole process {min(seconds):.1f}-{max(seconds):.1f} s" in read("README.md")


def test_the_readme_gives_the_tiers_sizes():
    """The README's "At scale" states the range of the scale files' lengths and of their plain twins'."""
    from conftest import ALGORITHMS

    def lines(path):
        with open(os.path.join(ROOT, path)) as f:
            return len(f.read().splitlines())

    plain, scale = [lines(n) for n in ALGORITHMS], [lines(f"scale/{n}") for n in ALGORITHMS]
    said = f"each scale file is {min(scale):,}-{max(scale):,} lines, its plain twin {min(plain):,}-{max(plain):,}"
    assert said.lower() in " ".join(read("README.md").split()).lower()


def test_the_readme_quotes_the_rlhf_pipeline_from_the_page_it_links():
    """The README links docs/ppo.md for the pipeline's numbers: they are that page's three-seed table's, and
    results.md's rows of the same runs."""
    readme, rows, ppo = read("README.md"), results(), table_rows("docs/ppo.md")
    new, old = start_end(rows["ppo-learned-rm"][1]), start_end(rows["ppo-learned-rm-one-pair"][1])
    said = " ".join(readme.split())
    assert f"takes held-out accuracy from {new[0]}% to {new[1]}%; with one pair a prompt" in said
    assert f"it fell to {old[1]}%, three seeds on the Xeon" in said
    three_seeds = {name.split(":")[0]: cells for name, cells in ppo.items() if name.startswith(("old:", "new"))}
    assert three_seeds["new (the defaults)"][2] == f"{new[0]} → {new[1]}"
    assert three_seeds["old"][2] == f"{old[0]} → {old[1]}"


def test_every_measured_number_of_the_readme_is_on_a_page_its_paragraph_links():
    """A percentage, a time in seconds or minutes or a memory in GiB in the README's prose (a paragraph or a list
    item) appears, as written, on a docs page that the same paragraph links to."""
    text = re.sub(r"```.*?```", "", raw("README.md"), flags=re.S)
    quantity = re.compile(r"(\d[\d,]*(?:\.\d+)?(?: ± \d+(?:\.\d+)?)?)(?=%| s\b| GiB| minutes)")
    checked = 0
    for paragraph in re.split(r"\n\s*\n|\n(?=- )", text):
        paragraph = " ".join(paragraph.split())
        numbers = quantity.findall(paragraph)
        if not numbers:
            continue
        linked = {target.split("#")[0] for target in re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)]*)?\)", paragraph)}
        assert linked, f"a paragraph quotes {numbers} and links no docs page: {paragraph[:120]}"
        pages = " ".join(read(page) for page in linked)
        for number in numbers:
            assert number in pages, f"{number} is on none of {sorted(linked)}: {paragraph[:120]}"
            checked += 1
    assert checked >= 8  # the set-up line's and the results' numbers


@pytest.mark.parametrize("page", PAGES)
def test_no_page_speaks_of_this_projects_issues(page):
    """A reader of the repository cannot follow "issue 74": what a page says stands without the project's history
    (which is the commit messages'). Other projects' threads are named with their project (TRL #5224)."""
    found = re.findall(r"\b[Ii]ssues? \d+(?:[-–]\d+)?", raw(page))
    assert not found, f"{page}: {found}"


def test_the_smollm2_page_quotes_the_results_page():
    page, rows = read("docs/smollm2.md"), results()
    real = []
    for name, label in (("grpo-smollm2", "GRPO"), ("rloo-smollm2", "RLOO"), ("dpo-smollm2", "DPO")):
        start, end = start_end(rows[name][1])
        real.append(f"{label} {start}% → {end}% in {rows[name][4]} s")
    best, peak = rows["grpo-smollm2"][2], rows["grpo-smollm2"][5]
    assert f"{real[0]} of wall time (best {best}%, {peak} GiB peak memory), {real[1]}, {real[2]}" in page


def test_the_gpu_page_quotes_the_bfloat16_comparison():
    gpu, page = read("docs/gpu.md"), read("docs/results.md")
    cells = {}
    for name in ("grpo-smollm2", "grpo-smollm2-bf16"):
        row = re.search(
            rf"\| {name} \| (float32|bfloat16) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|"
            rf" (\d+) \| ([\d.]+) → ([\d.]+) \|",
            page,
        )
        assert row, f"no {name} row in the bfloat16 section of docs/results.md"
        cells[name] = row.groups()
    f32, b16 = cells["grpo-smollm2"], cells["grpo-smollm2-bf16"]
    assert (
        f"{b16[1]} s a step against {f32[1]} s in float32, {b16[2]} GiB of peak memory against {f32[2]} GiB, and"
        f" held-out accuracy {b16[4]}% → {b16[5]}% against {f32[4]}% → {f32[5]}%"
    ) in gpu


def test_the_gpu_page_quotes_the_log_prob_memory():
    """The chunked log-probs' memory and time against the plain log_softmax, with gradient, in float32."""
    gpu, page = read("docs/gpu.md"), read("docs/results.md")
    lines = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in raw("docs/results.md").splitlines()
        if line.startswith(("| plain |", "| chunked |"))
    ]
    plain, chunked = (
        next(c for c in lines if c[:3] == [method, "forward + backward", "float32"]) for method in ("plain", "chunked")
    )
    ratio = re.search(r"with gradient, float32: ([\d.]+)× the memory, ([\d.]+)× the time", page)
    assert ratio
    assert (
        f"the chunked pass added {chunked[3]} GiB of peak memory where the plain `log_softmax` added {plain[3]}"
        f" GiB ({ratio[1]}× the memory, {ratio[2]}× the time)"
    ) in gpu


def test_the_vllm_page_quotes_the_vllm_comparison():
    vllm, page, rows = read("docs/vllm.md"), read("docs/results.md"), results()
    cells = {}
    for name in ("grpo", "grpo-vllm", "grpo-smollm2", "grpo-smollm2-vllm"):
        row = re.search(
            rf"\| {name} \| (generate\(\)|vLLM) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.e-]+|—) \|"
            rf" ([\d ±]+) \| ([\d.]+)(?: ± [\d.]+)? → ([\d.± ]+?) \|",
            page,
        )
        assert row, f"no {name} row in the vLLM section of docs/results.md"
        cells[name] = row.groups()
    hf, vl, hf2, vl2 = (cells[n] for n in ("grpo", "grpo-vllm", "grpo-smollm2", "grpo-smollm2-vllm"))
    assert (
        f"{vl[2]} s of generation a step against {hf[2]} s ({vl[3]} generated tokens/s against {hf[3]}), the"
        f" default run {vl[5]} s against {hf[5]} s"
    ) in vllm
    assert f"held-out accuracy still climbs from {vl[6]}% to {vl[7]}% (`generate()`: {hf[7]}%)" in vllm
    assert (
        f"generation takes {vl2[2]} s a step against {hf2[2]} s ({vl2[3]} generated tokens/s against {hf2[3]},"
        f" the weight copy included), a step {vl2[1]} s against {hf2[1]} s and the run {vl2[5]} s against"
        f" {hf2[5]} s, with {rows['grpo-smollm2-vllm'][5]} GiB of peak memory against"
        f" {rows['grpo-smollm2'][5]}"
    ) in vllm
    assert (
        f"held-out accuracy {vl2[6]}% → {vl2[7]}% (one seed; `generate()`: {hf2[6]}% → {hf2[7]}%)."
        f" `rollout/logprob_diff` stays at {vl[4]} and {vl2[4]}"
    ) in vllm
    # the versions of vLLM's environment, as results.md's section gives them
    torch, transformers = re.search(r"torch (2\.\d+)\.\d\+cpu, transformers (5\.\d+)\.\d", page).groups()
    assert f"torch {torch}." in vllm and f"transformers {transformers}." in vllm


def test_the_vllm_environments_are_named_alike():
    """The README and docs name the environment a user makes `.venv-vllm/`, which git ignores; the CI script makes
    `.ci-venv-vllm/`, as docs/vllm.md says."""
    ignored = raw(".gitignore").split()
    for page in PAGES:
        for name in re.findall(r"\.(?:ci-)?venv-vllm\b", raw(page)):
            assert f"{name}/" in ignored, f"{page} names {name}, which .gitignore does not ignore"
    assert "python3 -m venv .ci-venv-vllm\n" in raw(".ci/vllm-cpu-venv")
    assert "`.ci/vllm-cpu-venv` makes the same environment as `.ci-venv-vllm/`" in read("docs/vllm.md")
    assert "python3 -m venv .venv-vllm && source .venv-vllm/bin/activate" in raw("docs/vllm.md")
    assert "--vllm-python .venv-vllm/bin/python" in raw("README.md")


def test_the_gpu_page_gives_the_memory_estimate_of_its_commands():
    """docs/gpu.md's table is what benchmarks/memory_estimate.py prints, each row is a command that docs/gpu.md or
    docs/distributed.md gives (its file, model, data, micro-batch and checkpointing), and one row checks by hand:
    GRPO on Qwen2.5-0.5B keeps 16 bytes a parameter for the policy and 4 for the reference (float32, as the
    policy)."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import memory_estimate

    n = memory_estimate.parameters(memory_estimate.QWEN_05B)
    assert n == 494_032_768  # Qwen2.5-0.5B's parameters, its embedding tied to the output layer
    static, training, generation, peak = memory_estimate.estimate(memory_estimate.COMMANDS[0])
    # and the compiled step's bfloat16 copy of the decoder's linear layers: q and o 896 x 896, k and v 128 x 896, q,
    # k and v's biases, gate, up and down 896 x 4864, in 24 layers
    linear_05b = 24 * (2 * 896 * 896 + 2 * 128 * 896 + 896 + 2 * 128 + 3 * 896 * 4864)
    assert static == pytest.approx((20 * n + 2 * linear_05b) / 2**30)
    # micro-batches of 8 x 712 tokens with --gradient-checkpointing: the policy's bfloat16 weight copies, a float32
    # 896-vector a token for each of 24 layers plus one layer's 34 x 896 + 8 x 4864 + 4 x 14 heads + 8 + 2 x 712
    # bytes a token, and the output layer's backward: 5 chunks of 441 rows x 151,936 float32 logits (more than
    # 8 x 151,936 x 896 bytes of weight gradients)
    assert 5 * 441 * 151_936 * 4 > 8 * 151_936 * 896
    assert training == pytest.approx(
        (2 * n + 8 * 712 * (24 * 4 * 896 + 34 * 896 + 8 * 4864 + 4 * 14 + 8 + 2 * 712) + 5 * 441 * 151_936 * 4) / 2**30
    )
    # the one cache of 128 rows (the rollout batch, and an evaluation batch) of 256 + 512 positions (the prompt's 200
    # and the completion's 512 tokens in multiples of 64): keys and values of 24 layers, 2 heads of 64, in bfloat16;
    # and two float32 rows of 151,936 logits for each of the 128 rollouts
    assert generation == pytest.approx(128 * (2 * 24 * 2 * 64 * 768 * 2 + 2 * 151_936 * 4) / 2**30)
    assert peak == pytest.approx(static + max(training, generation))
    # the LoRA row at 7B: the frozen policy at 4 bytes a parameter, but 2 for its decoder's linear layers (held in
    # bfloat16: q and o 3584 x 3584, q's bias, k and v 512 x 3584 with their biases, gate, up and down 3584 x 18944,
    # in 28 layers), and 16 for each adapter parameter (rank 16 times the inputs and outputs of those 7 layers)
    lora = next(c for c in memory_estimate.COMMANDS if c.lora and c.model is memory_estimate.QWEN_7B)
    n7 = memory_estimate.parameters(memory_estimate.QWEN_7B)
    linear = 28 * (2 * 3584 * 3584 + 3584 + 2 * (512 * 3584 + 512) + 3 * 3584 * 18944)
    adapters = 16 * 28 * (2 * 3584 + 2 * (3584 + 512) + 2 * 3584 + 3 * (3584 + 18944))
    # and the compiled step's bfloat16 copy of the adapters (the base layers are read as they are held)
    assert memory_estimate.estimate(lora)[0] == pytest.approx((4 * n7 - 2 * linear + 18 * adapters) / 2**30)
    # the command the page gives prints the table, and the page gives it
    assert run_script("benchmarks/memory_estimate.py").stdout.strip() == memory_estimate.table()
    assert memory_estimate.table() in raw("docs/gpu.md")
    # each row is one of the commands given
    commands = [
        line.split()
        for page in ("docs/gpu.md", "docs/distributed.md", "docs/training.md")
        for block in re.findall(r"```bash\n(.*?)```", raw(page), flags=re.S)
        for line in block.splitlines()
        if line.startswith(("python ", "torchrun "))
    ]
    data = {"GSM8K": "openai/gsm8k"}
    for c in memory_estimate.COMMANDS:
        script, model, dataset = (part.strip() for part in c.name.split(","))
        script = next(word for word in script.split() if word.endswith(".py"))
        matches = [
            argv
            for argv in commands
            if script in [os.path.basename(word) for word in argv]  # the page's command: the plain file or its twin
            and f"Qwen/{model}" in argv
            and data.get(dataset, dataset) in argv
            and ("--fsdp" in argv) == (c.processes > 1)
            and "--nnodes" not in argv
            and ("--lora-r" in argv) == bool(c.lora)
        ]  # one machine
        assert len(matches) == 1, f"no single command on the pages for the row {c.name!r}"
        argv = matches[0]
        pairs = 2 if script in ("dpo.py", "reward_model.py") else 1  # a pair is two sequences
        assert int(argv[argv.index("--micro-batch-size") + 1]) * pairs == c.micro_batch, c.name
        assert ("--gradient-checkpointing" in argv) == c.checkpointing, c.name
        if c.processes > 1:
            assert argv[argv.index("--nproc-per-node") + 1] == str(c.processes), c.name


def test_the_async_page_says_its_grpo_wall_time_is_another_benchmarks_run():
    """docs/async_grpo.md's prose gives its own table's numbers (the runs' wall seconds at eta 0, their range with
    eta > 0, grpo.py's), and names results.md's wall time of the same command as another set of runs."""
    page, rows = read("docs/async_grpo.md"), table_rows("docs/async_grpo.md", columns=8)
    ahead = [cells for name, cells in rows.items() if name.startswith("eta") and "interrupt" not in name]
    assert len(ahead) == 6 and {"grpo.py", "sync"} <= set(rows)
    walls = sorted(int(cells[7].split(" ± ")[0]) for cells in ahead)
    sync = rows["sync"][7].split(" ± ")[0]
    assert f"(the runs {sync} s against {walls[0]} to {walls[-1]} s; grpo.py {rows['grpo.py'][7]} s" in page
    assert (
        f"which [results.md](results.md)'s benchmark, another set of runs of the same command, measured at"
        f" {results()['grpo'][4]} s"
    ) in page


def test_the_ppo_page_says_its_per_change_runs_are_older():
    """docs/ppo.md's per-change table (seed 1, made while choosing the defaults) and its three-seed table differ
    for seed 1; the page says which is which, with both tables' numbers."""
    page, text = read("docs/ppo.md"), raw("docs/ppo.md")
    new_default = re.search(
        r"\| all pairs \| \*\*lr 3e-5, KL target 0\.5, normalised \(the new default\)\*\* \| 300"
        r" \| ([\d.]+) ",
        text,
    )
    old_default = re.search(
        r"\| one pair \| lr 1e-4, β 0\.05, raw score \(the old default; benchmark run\) \| 300"
        r" \| ([\d.]+) ",
        text,
    )
    seeds = {
        name.split(":")[0]: cells[3].split(", ")[0]
        for name, cells in table_rows("docs/ppo.md").items()
        if name.startswith(("old:", "new"))
    }
    assert new_default and old_default and len(seeds) == 2
    assert (
        f"their seed-1 rows for the new default ({new_default[1]}%) and the old default ({old_default[1]}%)"
        f" are not the {seeds['new (the defaults)']}% and {seeds['old']}% that seed 1 ends at in that table"
    ) in page


def test_the_algorithm_pages_name_the_update_time_not_the_old_key():
    for page in PAGES:
        if page != "docs/results.md":  # written by the benchmark from runs that logged the old key
            assert "forward_backward_time" not in raw(page), page
    assert "`charts/update_time`" in raw("docs/grpo.md") and "`charts/update_time`" in raw("docs/outputs.md")


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), each space a hyphen."""
    text = unicodedata.normalize("NFC", heading.strip().lower())
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", raw(path), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def links(path):
    """(target, anchor) of every link and image of a page's prose (code blocks and code spans left out)."""
    text = re.sub(r"```.*?```", "", raw(path), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        found.append((file, anchor))
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    """Each relative link of the README and the docs pages names a file of the repository, and its #anchor, if
    any, a heading of that page."""
    here = os.path.dirname(os.path.join(ROOT, page))
    for file, anchor in links(page):
        path = os.path.normpath(os.path.join(here, file)) if file else os.path.join(ROOT, page)
        assert path.startswith(ROOT + os.sep) and os.path.isfile(path), f"{page}: no file {file}"
        if anchor:
            assert path.endswith(".md"), f"{page}: an anchor into {file}, which is not a page"
            assert anchor in anchors(os.path.relpath(path, ROOT)), f"{page}: no heading #{anchor} in {file or page}"


def test_the_link_check_can_fail():
    """The checks above see a missing file and a missing heading (and GitHub's anchors as GitHub writes them)."""
    assert (
        slug("Rollouts from a vLLM engine (`--vllm`) against `generate()`")
        == "rollouts-from-a-vllm-engine---vllm-against-generate"
    )
    assert slug("bfloat16 on this project's CPU") == "bfloat16-on-this-projects-cpu"
    assert ("nowhere.md", "") not in links("README.md")
    assert "no-such-heading" not in anchors("docs/gpu.md") and "memory" in anchors("docs/gpu.md")
    assert {
        "docs/distributed.md",
        "docs/vllm.md",
        "docs/outputs.md",
        "docs/gpu.md",
        "docs/smollm2.md",
        "docs/your_own_task.md",
        "docs/results.md",
    } <= {file for file, _ in links("README.md")}
