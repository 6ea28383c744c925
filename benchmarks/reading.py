"""The reading measures of the algorithm files (docs/reading.md), counted on the code as ruff formats it.

For each file: its lines; main()'s lines and those of its longest loop inside another loop (grpo.py's minibatch
loop); the conditional expressions (`a if c else b`) above the banner, per 1,000 lines there, and below it; nested
ones; value selections with and/or (`x = a or b`: a BoolOp used for its value whose last operand is not a
comparison or a test); and the code lines (comments and docstrings left out) by which a sibling differs from the file
it is diffed against. START holds the same numbers on the code as it stood before the redesign (commit e8763f5,
each file put through `ruff format`), so that each row shows before and after.

The second table follows main() as a reader does: the lines (not blank) between main()'s end and
the first banner (where the reader stops), whether reward_fn stands above that banner, and main()'s calls of the
machinery (the functions defined below main()) in the order main() first makes them: how many, how many of them
jump backwards (to a definition above the one before), and the lines scrolled (the sum of the distances between
the definitions, starting from main()'s first line). START_WALK holds them at commit 390253d, before the layout
of the redesign.

The first table, tiers_table, sets each plain file (the top level) beside its scale twin (scale/): their lines and
main()'s, the plain main()'s lines that the scale main() changes or drops, and the lines of `diff plain scale`.

    python benchmarks/reading.py            # the three tables
    python benchmarks/reading.py --json     # the same numbers, for tests/test_style.py
"""

import ast
import difflib
import io
import json
import os
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [
    "scale/grpo.py",
    "scale/rloo.py",
    "scale/gspo.py",
    "scale/cispo.py",
    "scale/ppo.py",
    "scale/dpo.py",
    "scale/reward_model.py",
    "scale/sft.py",
    "scale/async_grpo.py",
    "scale/process_grpo.py",
    "scale/tool_grpo.py",
    "scale/dapo.py",
    "scale/distill.py",
    "scale/env_grpo.py",
]
BANNER = "# ==== Everything below this line is the same in every file"
READER_STOPS = "# ==== The algorithm ends here."
# each sibling against the file it is closest to: the files that sample against grpo.py (ppo.py against rloo.py:
# both reward a whole completion with the KL in it), dpo.py against reward_model.py (both train on preference pairs)
PAIRS = {
    "scale/rloo.py": "scale/grpo.py",
    "scale/gspo.py": "scale/grpo.py",
    "scale/cispo.py": "scale/grpo.py",
    "scale/async_grpo.py": "scale/grpo.py",
    "scale/process_grpo.py": "scale/grpo.py",
    "scale/tool_grpo.py": "scale/grpo.py",
    "scale/dapo.py": "scale/grpo.py",
    "scale/distill.py": "scale/grpo.py",
    "scale/env_grpo.py": "scale/grpo.py",
    "scale/ppo.py": "scale/rloo.py",
    "scale/dpo.py": "scale/reward_model.py",
}
# the same measures at commit e8763f5, formatted with ruff 0.17.5 (line length 120); process_grpo.py and
# tool_grpo.py came after
START = {
    "scale/grpo.py": {"lines": 1245, "main": 190, "inner_loop": 39, "ifexp_above": 12, "ifexp_below": 41},
    "scale/rloo.py": {"lines": 1157, "main": 155, "inner_loop": 21, "ifexp_above": 7, "ifexp_below": 41},
    "scale/gspo.py": {"lines": 1176, "main": 159, "inner_loop": 26, "ifexp_above": 7, "ifexp_below": 41},
    "scale/cispo.py": {"lines": 1178, "main": 161, "inner_loop": 28, "ifexp_above": 7, "ifexp_below": 41},
    "scale/ppo.py": {"lines": 1438, "main": 263, "inner_loop": 37, "ifexp_above": 16, "ifexp_below": 41},
    "scale/dpo.py": {"lines": 1142, "main": 131, "inner_loop": 24, "ifexp_above": 9, "ifexp_below": 41},
    "scale/reward_model.py": {"lines": 1110, "main": 111, "inner_loop": 16, "ifexp_above": 8, "ifexp_below": 41},
    "scale/sft.py": {"lines": 1050, "main": 134, "inner_loop": 11, "ifexp_above": 0, "ifexp_below": 41},
    "scale/async_grpo.py": {"lines": 1363, "main": 206, "inner_loop": 31, "ifexp_above": 15, "ifexp_below": 41},
}
# the walk through main()'s calls at commit 390253d, before the layout of one banner below main()'s helpers;
# distill.py came after it
START_WALK = {
    "scale/grpo.py": {"after_main": 181, "reward_fn": "below", "calls": 38, "jumps": 20, "scrolled": 12877},
    "scale/rloo.py": {"after_main": 175, "reward_fn": "below", "calls": 37, "jumps": 20, "scrolled": 12854},
    "scale/gspo.py": {"after_main": 180, "reward_fn": "below", "calls": 36, "jumps": 18, "scrolled": 12236},
    "scale/cispo.py": {"after_main": 180, "reward_fn": "below", "calls": 36, "jumps": 18, "scrolled": 12237},
    "scale/ppo.py": {"after_main": 281, "reward_fn": "below", "calls": 44, "jumps": 23, "scrolled": 18783},
    "scale/dpo.py": {"after_main": 154, "reward_fn": "below", "calls": 28, "jumps": 13, "scrolled": 9715},
    "scale/reward_model.py": {"after_main": 169, "reward_fn": "below", "calls": 24, "jumps": 10, "scrolled": 10769},
    "scale/sft.py": {"after_main": 145, "reward_fn": "below", "calls": 24, "jumps": 10, "scrolled": 9711},
    "scale/async_grpo.py": {"after_main": 202, "reward_fn": "below", "calls": 33, "jumps": 17, "scrolled": 10999},
    "scale/process_grpo.py": {"after_main": 305, "reward_fn": "below", "calls": 40, "jumps": 19, "scrolled": 15704},
    "scale/tool_grpo.py": {"after_main": 354, "reward_fn": "below", "calls": 36, "jumps": 17, "scrolled": 14282},
    "scale/dapo.py": {"after_main": 287, "reward_fn": "below", "calls": 34, "jumps": 18, "scrolled": 13212},
}
# the functions a sibling lacks because it samples without vLLM (async_grpo.py, tool_grpo.py): listed apart
# from the algorithm's lines in its diff with grpo.py
NOT_ALGORITHM = {
    "scale/async_grpo.py": [
        "VLLM_RANGES",
        "check_vllm",
        "load_engine",
        "sample",
        "sync_engine",
        "rollout_correction",
        "settle_correction",
    ],
    "scale/tool_grpo.py": [
        "VLLM_RANGES",
        "check_vllm",
        "load_engine",
        "sample",
        "sync_engine",
        "rollout_correction",
        "settle_correction",
    ],
    "scale/env_grpo.py": [
        "VLLM_RANGES",
        "check_vllm",
        "load_engine",
        "sample",
        "sync_engine",
        "rollout_correction",
        "settle_correction",
    ],
}
BOOLEAN_CALLS = {
    "isinstance",
    "hasattr",
    "any",
    "all",
    "bool",
    "callable",
    "endswith",
    "startswith",
    "exists",
    "isfile",
    "isdir",
    "is_initialized",
    "is_available",
    "is_bf16_supported",
    "is_grad_enabled",
    "isfinite",
    "is_floating_point",
}


def is_boolean(node):
    """Whether an expression is plainly true or false: a comparison, a not, a test call, or and/or of those."""
    if isinstance(node, ast.BoolOp):
        return all(is_boolean(value) for value in node.values)
    if isinstance(node, ast.Call):
        return getattr(node.func, "attr", getattr(node.func, "id", "")) in BOOLEAN_CALLS
    return isinstance(node, ast.Compare) or isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def value_selections(tree):
    """The and/or expressions used for their value (`a or b` as a default), not as a test."""
    tests = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tests.add(id(node.test))
        elif isinstance(node, ast.comprehension):
            tests.update(id(test) for test in node.ifs)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests.add(id(node.operand))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BoolOp):
            if id(node) not in tests and not is_boolean(node.values[-1]):
                found.append(node)
            tests.update(id(value) for value in node.values)
    return found


def code_lines(source):
    """The source's non-blank lines with comments and docstrings (strings that stand alone as a statement) removed."""
    lines = [list(line) for line in source.splitlines()]
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        standalone = token.type == tokenize.STRING and previous in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE)
        if token.type == tokenize.COMMENT or standalone:
            (first, start), (last, end) = token.start, token.end
            for row in range(first, last + 1):
                for col in range(start if row == first else 0, end if row == last else len(lines[row - 1])):
                    lines[row - 1][col] = ""
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
    return [text.rstrip() for text in ("".join(line) for line in lines) if text.strip()]


def without(source, names):
    """The source without the top-level definitions named."""
    lines = source.splitlines(keepends=True)
    for node in sorted(ast.parse(source).body, key=lambda node: -node.lineno):
        name = getattr(node, "name", None)
        if name is None and isinstance(node, ast.Assign):
            name = getattr(node.targets[0], "id", None)
        if name in names:
            start = node.lineno - 1 - len(getattr(node, "decorator_list", []))
            del lines[start : node.end_lineno]
    return "".join(lines)


def changed_code_lines(a, b):
    """The code lines of a diff between two sources, comments and docstrings aside."""
    diff = difflib.unified_diff(code_lines(a), code_lines(b), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def measure(source):
    lines = source.splitlines()
    banner = next(i for i, line in enumerate(lines) if line.startswith(BANNER)) + 1
    tree = ast.parse(source)
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    loops = [node for node in ast.walk(main) if isinstance(node, (ast.For, ast.While))]
    inner = [
        loop
        for loop in loops
        if any(
            outer is not loop and outer.lineno <= loop.lineno and loop.end_lineno <= outer.end_lineno for outer in loops
        )
    ]
    ifexps = [node for node in ast.walk(tree) if isinstance(node, ast.IfExp)]
    above = sum(node.lineno < banner for node in ifexps)
    return {
        "lines": len(lines),
        "main": main.end_lineno - main.lineno + 1,
        "inner_loop": max((loop.end_lineno - loop.lineno + 1 for loop in inner), default=0),
        "ifexp_above": above,
        "ifexp_above_per_1000": round(1000 * above / banner, 1),
        "ifexp_below": len(ifexps) - above,
        "ifexp_nested": sum(any(isinstance(c, ast.IfExp) for c in ast.walk(n) if c is not n) for n in ifexps),
        "value_selections": len(value_selections(tree)),
        "longest_line": max(len(line) for line in lines),
    }


def walk(source):
    """main()'s calls of what is defined below it, followed as a reader does (the second table)."""
    lines = source.splitlines()
    tree = ast.parse(source)
    defs = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    main = defs["main"]
    stops = next(i for i, line in enumerate(lines) if line.startswith((READER_STOPS, BANNER))) + 1
    calls = [node for node in ast.walk(main) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    order = []
    for call in sorted(calls, key=lambda node: (node.lineno, node.col_offset)):
        name = call.func.id
        if name in defs and defs[name].lineno > main.end_lineno and name not in order:
            order.append(name)
    jumps, scrolled, at = 0, 0, main.lineno
    for name in order:
        jumps += defs[name].lineno < at
        scrolled += abs(defs[name].lineno - at)
        at = defs[name].lineno
    reward_fn = "above" if defs["reward_fn"].lineno < stops else "below"
    return {
        "after_main": sum(1 for line in lines[main.end_lineno : stops - 1] if line.strip()),
        "reward_fn": reward_fn,
        "calls": len(order),
        "jumps": jumps,
        "scrolled": scrolled,
    }


def measures():
    """{file: its measures, with 'diff' against its PAIRS file and 'not_algorithm', the diff's lines listed apart}"""
    sources = {name: open(os.path.join(ROOT, name), encoding="utf-8").read() for name in FILES}
    found = {name: {**measure(source), "walk": walk(source)} for name, source in sources.items()}
    for name, against in PAIRS.items():
        apart = NOT_ALGORITHM.get(name, [])
        algorithm = changed_code_lines(without(sources[against], apart), without(sources[name], apart))
        found[name]["diff"] = len(algorithm)
        found[name]["against"] = against
        found[name]["not_algorithm"] = len(changed_code_lines(sources[against], sources[name])) - len(algorithm)
    return found


def main_lines(source):
    """main()'s lines as ruff lays them out, from `def main(args):` to the first banner (blank lines at the end
    aside)."""
    start = source.index("\ndef main(args):") + 1
    return source[start : source.index(READER_STOPS, start)].rstrip("\n").splitlines()


def main_changes(plain, scale):
    """The plain main()'s lines that the scale main() changes or drops (difflib's replaced and deleted lines)."""
    a, b = main_lines(plain), main_lines(scale)
    opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return [a[k] for tag, i1, i2, _, _ in opcodes if tag in ("replace", "delete") for k in range(i1, i2)]


def tiers_table():
    """Each plain file beside its scale twin."""
    rows = [
        "| file | lines: plain, scale | main(): plain, scale | plain main() lines the scale main() changes | "
        "`diff` lines | the shared part's lines: plain, scale |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in FILES:
        plain_name = os.path.basename(name)
        if not os.path.exists(os.path.join(ROOT, plain_name)):
            continue
        plain, scale = (open(os.path.join(ROOT, n), encoding="utf-8").read() for n in (plain_name, name))
        diff = list(difflib.unified_diff(plain.splitlines(), scale.splitlines(), lineterm="", n=0))
        changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        shared = [len(text[text.index(BANNER) :].splitlines()) for text in (plain, scale)]
        rows.append(
            f"| {plain_name} | {plain.count(chr(10))}, {scale.count(chr(10))} | {len(main_lines(plain))}, "
            f"{len(main_lines(scale))} | {len(main_changes(plain, scale))} | {changed} | {shared[0]}, {shared[1]} |"
        )
    return "\n".join(rows)


def table(found):
    rows = [
        "| file | lines | main() | its inner loop | `if else` above the banner (per 1,000) | below | nested | "
        "value and/or | code lines differing from |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in found.items():
        start = START.get(name, {k: "new" for k in ("lines", "main", "inner_loop", "ifexp_above", "ifexp_below")})
        diff = f"{m['diff']} ({m['against']})" if "diff" in m else ""
        if m.get("not_algorithm"):
            diff += f" + {m['not_algorithm']} of vLLM and torchrun code"
        rows.append(
            f"| {name} | {start['lines']} → {m['lines']} | {start['main']} → {m['main']} | "
            f"{start['inner_loop']} → {m['inner_loop']} | {start['ifexp_above']} → {m['ifexp_above']} "
            f"({m['ifexp_above_per_1000']}) | {start['ifexp_below']} → {m['ifexp_below']} | {m['ifexp_nested']} | "
            f"{m['value_selections']} | {diff} |"
        )
    return "\n".join(rows)


def walk_table(found):
    rows = [
        "| file | lines between main()'s end and the banner | reward_fn | machinery main() calls | jumps backwards | "
        "lines scrolled |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in found.items():
        start, now = START_WALK.get(name, dict.fromkeys(m["walk"], "new")), m["walk"]
        cells = [f"{start[k]} → {now[k]}" for k in ("after_main", "reward_fn", "calls", "jumps", "scrolled")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    found = measures()
    if "--json" in sys.argv:
        print(json.dumps(found, indent=1))
    else:
        print(tiers_table() + "\n\n" + table(found) + "\n\n" + walk_table(found))
