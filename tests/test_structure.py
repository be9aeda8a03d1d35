"""The package's shape (docs/design.md): layers that import only downward, no import cycle
(imports inside functions counted), every import inside a function with its reason next to it,
no benchmark code in the package, functions and classes of a size a reader can hold; the
library's tests apart from the benchmarks' and the evaluation's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import its own layer and those below, never one above.
LAYERS = [
    ["fasthealth.ops", "fasthealth.triton_kernels"],  # the one op
    ["fasthealth.stats", "fasthealth.params", "fasthealth.distributed",
     "fasthealth.replicas"],  # views, inputs, ranks
    ["fasthealth.checks"],  # the public checks
    ["fasthealth.activations", "fasthealth.optim"],
    ["fasthealth.monitor"],  # the training-loop monitor
    ["fasthealth.integrations"],  # one file per trainer
    ["fasthealth"],  # the package's public names (__init__.py)
    ["fasthealth.cli", "fasthealth.__main__", "fasthealth.report", "fasthealth.selftest",
     "fasthealth.demo", "fasthealth.faults"],  # tools: nothing in the package imports them
    # (the CLI on demand)
]
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 300
# The report's parts, each importing only those before it (fasthealth/report/__init__.py)
REPORT_PARTS = ["read", "runs", "summary", "heatmap", "plots", "html", "cli"]


def modules() -> dict[str, Path]:
    out = {}
    for folder, prefix in ((ROOT / "fasthealth", ["fasthealth"]),
                           (ROOT / "triton_kernels", ["fasthealth", "triton_kernels"])):
        for p in sorted(folder.rglob("*.py")):
            parts = prefix + list(p.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = modules()


def layer(name: str) -> int:
    best, depth = None, -1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (name == prefix or name.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, f"{name} is in no layer of tests/test_structure.py"
    return best


def imports(name: str) -> list[tuple[str, ast.stmt, bool]]:
    """(imported fasthealth module, the statement, whether it sits inside a function)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
             for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)}
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix
                       for a in node.names]
        for t in targets:
            if t.split(".")[0] == "fasthealth":
                out.append((t, node, id(node) in inner))
    return out


def test_every_module_imports_only_its_layer_and_below():
    wrong = []
    for name in MODULES:
        for target, node, _ in imports(name):
            if layer(target) > layer(name):
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {name} (layer "
                             f"{layer(name)}) imports {target} (layer {layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_the_op_layer_imports_nothing_above_it():
    for name in MODULES:
        if layer(name) == 0:
            assert all(layer(t) == 0 for t, _, _ in imports(name)), name


def test_no_import_cycle():
    graph = {name: {t for t, _, _ in imports(name) if t in MODULES and t != name}
             for name in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            assert state.get(m) != 1, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def _function_imports(path: Path) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    return [n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            for n in ast.walk(f) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_every_import_inside_a_function_says_why():
    """An import belongs at the top of its file; one inside a function (an optional dependency,
    a slow import kept off the common path) carries its reason on its line or just above."""
    silent = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for node in _function_imports(path):
            near = lines[max(0, node.lineno - 3):node.end_lineno]
            if not any("#" in line for line in near):
                silent.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not silent, "imports inside functions without a reason:\n" + "\n".join(silent)


def test_no_benchmark_code_in_the_package():
    for path in MODULES.values():
        assert "bench" not in path.stem, f"{path}: benchmarks live in bench/"
        text = path.read_text()
        assert "read_floor" not in text and "chunk_touch" not in text, path
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".cpp", ".cu", ".h", ".cuh"):
            for i in _read_probe_only_violations(path):
                raise AssertionError(f"{path}:{i} names chunk_touch outside the bench-only "
                                     "FASTHEALTH_READ_PROBE build")


def _read_probe_only_violations(path: Path) -> list[int]:
    """Lines of code (not comments) naming chunk_touch outside ``#ifdef FASTHEALTH_READ_PROBE``:
    the preprocessor's nesting is followed (True: inside the probe's branch)."""
    stack: list[bool | None] = []
    bad = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        word = line.strip()
        if word.startswith("#if"):
            stack.append(True if word.startswith("#ifdef FASTHEALTH_READ_PROBE") else
                         False if word.startswith("#ifndef FASTHEALTH_READ_PROBE") else None)
        elif word.startswith("#else") and stack and stack[-1] is not None:
            stack[-1] = not stack[-1]
        elif word.startswith("#endif") and stack:
            stack.pop()
        code = line.split("//")[0]
        if "chunk_touch" in code and True not in stack:
            bad.append(i)
    return bad


def test_functions_and_classes_stay_readable():
    big = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if not isinstance(node, ast.ClassDef) and size > MAX_FUNCTION_LINES:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} def {node.name}: {size}")
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}: {size}")
    assert not big, "\n".join(big)


def test_the_layers_name_every_module():
    for name in MODULES:
        layer(name)  # asserts


def test_design_md_draws_these_layers():
    """docs/design.md's layer diagram names each module in the layer LAYERS puts it in."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## The layers", 1)[1].split("```", 2)[1]
    rows: dict[int, str] = {}
    current = None
    for line in block.splitlines():
        head = line.split(maxsplit=1)
        if head and head[0].isdigit():
            current = int(head[0])
            rows[current] = line
        elif current is not None and line.startswith(" " * 10) and "---" not in line:
            rows[current] += " " + line
        elif "---" in line:
            current = None
    assert sorted(rows) == list(range(1, len(LAYERS) + 1)), sorted(rows)
    for i, names in enumerate(LAYERS, start=1):
        for prefix in names:
            short = prefix.rsplit(".", 1)[-1]
            assert short in rows[i].split() or f"{short}/" in rows[i] or \
                f"{short} (" in rows[i], f"docs/design.md: layer {i} does not name {short}"


def test_no_module_is_longer_than_a_reader_can_hold():
    package = ROOT / "fasthealth"
    long = {name: n for name, path in MODULES.items() if path.is_relative_to(package)
            and (n := len(path.read_text().splitlines())) > 500}
    assert not long, long


def test_the_report_is_in_parts_that_import_in_order():
    """One idea per file under fasthealth/report/: the parts import only those before them
    (the reader at the bottom, the command on top)."""
    parts = [f"fasthealth.report.{p}" for p in REPORT_PARTS]
    in_package = sorted(n for n in MODULES if n.startswith("fasthealth.report."))
    assert in_package == sorted(parts), "a new part of the report: add it to REPORT_PARTS"
    for i, name in enumerate(parts):
        for target, node, _ in imports(name):
            if target.startswith("fasthealth.report"):
                assert target in parts[:i], f"{name}:{node.lineno} imports {target}"


def test_pyproject_lists_every_package():
    """A package missing from [tool.setuptools] packages installs without its files: an
    editable install (tests, CI) hides that, a user's `pip install .` does not."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert found == listed, (found - listed, listed - found)


# The benchmarks' and the evaluation's modules, by the bare names their folders import them by
TOOLING = {p.stem for folder in ("bench", "evaluation", "evaluation/detectors")
           for p in (ROOT / folder).glob("*.py")} | {"trainers", "detectors"}


def test_the_library_tests_import_no_benchmark_or_evaluation_code():
    """tests/ tests the library: it imports nothing of bench/ or evaluation/, puts neither on
    sys.path, and holds no test of their tiers (corpus, device_script): those live in
    bench/tests/ and evaluation/tests/, which `make test-eval` runs."""
    wrong = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in TOOLING]
        if path.name == "test_structure.py":
            continue  # names what it looks for
        for i, line in enumerate(text.splitlines(), 1):
            if ("sys.path" in line or "PYTHONPATH" in line) and \
                    ("bench" in line or "evaluation" in line):
                wrong.append(f"{path.relative_to(ROOT)}:{i} puts bench/ or evaluation/ on "
                             "the path")
            if "mark.corpus" in line or "mark.device_script" in line:
                wrong.append(f"{path.relative_to(ROOT)}:{i} an evaluation tier's test in tests/")
    assert not wrong, "\n".join(wrong)


def test_the_test_folders_follow_the_package():
    """A test folder under tests/ is named after the package part it tests, and every test
    file's name is unique across the three test folders (pytest imports them by bare name)."""
    for folder in (ROOT / "tests").iterdir():
        if folder.is_dir() and any(folder.glob("test_*.py")):
            assert (ROOT / "fasthealth" / folder.name).is_dir(), \
                f"tests/{folder.name}/: no fasthealth/{folder.name}/ to follow"
    names = [p.name for d in ("tests", "bench/tests", "evaluation/tests")
             for p in (ROOT / d).rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_the_readme_stays_a_landing_page():
    """The README says what fasthealth is, how to install it, three lines, a loop, the
    trainers and where to read on; the rest is the guide's (docs/guide/, the site)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines: move a section to docs/guide/"
