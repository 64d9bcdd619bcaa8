"""The house by role (docs/architecture.md): each part of `bert_jax` imports only the layers drawn
below it, `pretrain/` and `finetune/` never import each other, the parts import each other in no
cycle; `data_pipeline` never imports `bert_jax` or jax, its stages (storage -> tokenization ->
records -> pretraining_data -> input, tasks) import only the stages below them, in no cycle; no
module of either package has a `__getattr__` hook; and no source file passes 600 lines (no test
file 800). The tests' own layout (docs/architecture.md): code they share lives in tests/helpers/,
fixtures a folder's tests share in its conftest.py; no test module imports another test module,
and no test edits sys.path.

Imports are read from the source (every `import` statement, function-level ones included), so a
lazy import up the layers fails here as a module-level one does."""

import ast
import functools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The layers of docs/architecture.md's drawing, bottom up: a part imports only parts of its own
# layer or below.
LAYERS = (
    ("bert_jax", "layout", "exit_codes"),  # the package's root, the workdir's names, exit codes
    ("model/",),
    ("checkpoints/", "formats/", "convert"),
    ("training/", "workdir", "versions", "config_overrides"),
    ("pretrain/", "finetune/"),
    ("main", "plan", "fill_mask", "extract_features", "demo", "pod/", "plot"),  # the entry points
)
LAYER = {part: i for i, parts in enumerate(LAYERS) for part in parts}

# data_pipeline's stages, bottom up (docs/architecture.md): the package's root, `tf_import` (TensorFlow
# without Keras) and `masking_rule` (BERT's 80/10/10, shared by the three maskers), then one folder per
# stage, then the two command-line programs.
DP_LAYERS = (
    ("data_pipeline", "tf_import", "masking_rule"),
    ("storage/",),
    ("tokenization/",),
    ("records/",),
    ("pretraining_data/",),
    ("input/", "tasks/"),  # neither imports the other
    ("create_pretraining_data", "train_vocab"),  # python -m data_pipeline.<name>
)
DP_LAYER = {part: i for i, parts in enumerate(DP_LAYERS) for part in parts}


def part_of(module: str, package: str = "bert_jax"):
    """`bert_jax.pretrain.loop` -> "pretrain/", `bert_jax.workdir` -> "workdir",
    `data_pipeline.records.reader` -> "records/" (None outside `package`)."""
    names = module.split(".")
    if names[0] != package:
        return None
    if len(names) == 1:
        return package
    return names[1] + "/" if os.path.isdir(os.path.join(ROOT, package, names[1])) else names[1]


def imports(path: str) -> set:
    """Every module `path` imports (`from bert_jax import x` counts as `bert_jax.x`; an
    `importlib.import_module("bert_jax.x")` of a literal name counts too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            top = node.module.split(".")[0] in ("bert_jax", "data_pipeline") and "." not in node.module
            found.update(f"{node.module}.{alias.name}" for alias in node.names) if top else found.add(node.module)
    return found


def modules(package: str):
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                yield module, path


@functools.lru_cache(maxsize=None)
def part_graph(package: str = "bert_jax") -> dict:
    """part -> the parts of `package` it imports (read once per test process; the tests only read it)."""
    graph: dict = {}
    for module, path in modules(package):
        mine = part_of(module, package)
        for target in imports(path):
            other = part_of(target, package)
            if other and other != mine:
                graph.setdefault(mine, set()).add(other)
    return graph


def find_cycle(graph: dict):
    """One import cycle of `graph` as a list of parts, or None."""
    state: dict = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path + [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_every_part_is_drawn_in_a_layer():
    parts = {part_of(module) for module, _ in modules("bert_jax")}
    assert parts - set(LAYER) == set(), "a new part of bert_jax: draw it in docs/architecture.md and LAYERS"


def test_each_part_imports_only_its_layer_and_below():
    wrong = [f"{mine} (layer {LAYER[mine]}) imports {other} (layer {LAYER[other]})"
             for mine, others in part_graph().items() for other in others if LAYER[other] > LAYER[mine]]
    assert not wrong, wrong


def test_pretraining_and_fine_tuning_do_not_import_each_other():
    graph = part_graph()
    assert "finetune/" not in graph.get("pretrain/", set())
    assert "pretrain/" not in graph.get("finetune/", set())


@pytest.mark.parametrize("package", ["bert_jax", "data_pipeline"])
def test_the_parts_import_each_other_in_no_cycle(package):
    cycle = find_cycle(part_graph(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_data_pipeline_imports_neither_bert_jax_nor_jax():
    wrong = [(module, target) for module, path in modules("data_pipeline") for target in imports(path)
             if target.split(".")[0] in ("bert_jax", "jax", "flax")]
    assert not wrong, wrong


def test_every_data_pipeline_stage_is_drawn_in_a_layer():
    parts = {part_of(module, "data_pipeline") for module, _ in modules("data_pipeline")}
    assert parts - set(DP_LAYER) == set(), "a new part of data_pipeline: draw it in docs/architecture.md and DP_LAYERS"


def test_each_data_pipeline_stage_imports_only_its_layer_and_below():
    wrong = [f"{mine} (layer {DP_LAYER[mine]}) imports {other} (layer {DP_LAYER[other]})"
             for mine, others in part_graph("data_pipeline").items() for other in others
             if DP_LAYER[other] > DP_LAYER[mine]]
    assert not wrong, wrong


def test_input_and_tasks_do_not_import_each_other():
    graph = part_graph("data_pipeline")
    assert "tasks/" not in graph.get("input/", set())
    assert "input/" not in graph.get("tasks/", set())


def test_each_data_pipeline_stage_folder_says_what_it_is():
    for part in DP_LAYER:
        if part.endswith("/"):
            init = os.path.join(ROOT, "data_pipeline", part, "__init__.py")
            assert ast.get_docstring(ast.parse(open(init, encoding="utf-8").read())), f"{init}: no docstring"


@pytest.mark.parametrize("package", ["bert_jax", "data_pipeline"])
def test_no_module_has_a_getattr_hook(package):
    """A module-level `__getattr__` (PEP 562) serves names from elsewhere, unseen by these scans."""
    hooks = [module for module, path in modules(package)
             for node in ast.parse(open(path, encoding="utf-8").read()).body
             if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")]
    assert not hooks, hooks


@pytest.mark.parametrize("package", ["bert_jax", "data_pipeline"])
def test_no_source_file_passes_600_lines(package):
    long = {module: n for module, path in modules(package)
            if (n := sum(1 for _ in open(path, encoding="utf-8"))) > 600}
    assert not long, long


def test_no_test_file_passes_800_lines():
    long = {module: n for module, path in modules("tests")
            if (n := sum(1 for _ in open(path, encoding="utf-8"))) > 800}
    assert not long, long


# ---------------------------------------------------------------------------------------------
# The tests' layout: shared code in tests/helpers/, shared fixtures in each folder's conftest.py
# ---------------------------------------------------------------------------------------------

HELPERS = os.path.join("tests", "helpers")
# A path into tests/, looked for on the lines that set a child process's import path.
INTO_TESTS = re.compile(r"""["']tests["']|/tests\b""")


def files_under_tests():
    """(path relative to the root, absolute path) of every Python file under tests/."""
    for _, path in modules("tests"):
        yield os.path.relpath(path, ROOT), path


def full_imports(path: str) -> set:
    """Every module and every `from` name `path` imports, in full (`from tests.helpers import x`
    gives `tests.helpers` and `tests.helpers.x`); a relative import as `.name`."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.add(module)
            found.update(f"{module}.{alias.name}" if node.module else module + alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def test_no_test_module_imports_another_test_module_or_a_conftest():
    """What two test modules share goes to tests/helpers/ (code) or their folder's conftest.py
    (fixtures, which pytest hands out by name: importing one copies it into the module)."""
    wrong = [(rel, target) for rel, path in files_under_tests() for target in full_imports(path)
             if target.startswith(".") or any(part.startswith("test_") or part == "conftest"
                                              for part in target.split("."))]
    assert not wrong, wrong


def test_no_test_edits_sys_path():
    """Tests import the project and tests.helpers from the repository root, which pytest puts on
    sys.path (tests/__init__.py); children get it through PYTHONPATH, never a tests/ folder."""
    wrong = []
    for rel, path in files_under_tests():
        source = open(path, encoding="utf-8").read()
        for node in ast.walk(ast.parse(source)):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value  # sys.path.insert(...), ....append, ...
                if node.func.attr == "syspath_prepend":  # monkeypatch.syspath_prepend(...)
                    wrong.append((rel, node.lineno))
                    continue
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                for t in getattr(node, "targets", [getattr(node, "target", None)]):
                    target = t.value if isinstance(t, ast.Subscript) else t
                    if ast.unparse(target) == "sys.path":
                        break
            if target is not None and ast.unparse(target) == "sys.path":
                wrong.append((rel, node.lineno))
        wrong += [(rel, n) for n, line in enumerate(source.splitlines(), 1)
                  if "PYTHONPATH" in line and INTO_TESTS.search(line)]
    assert not wrong, wrong


def test_helpers_live_in_tests_helpers_and_the_test_folders_are_not_packages():
    """Outside tests/helpers/ a tests/ file is a test module (test_*.py) or a conftest.py; inside it,
    neither. Package markers: tests/__init__.py and tests/helpers/__init__.py only, so that every
    test module is imported the same way (by its file name, pytest's default import mode)."""
    wrong = []
    for rel, _ in files_under_tests():
        folder, name = os.path.split(rel)
        if folder == HELPERS:
            if name.startswith("test_") or name == "conftest.py":
                wrong.append(rel)
        elif name == "__init__.py":
            if folder != "tests":
                wrong.append(rel)
        elif not (name.startswith("test_") or name == "conftest.py"):
            wrong.append(rel)
    assert not wrong, f"{wrong}: shared code goes to {HELPERS}/, fixtures to a folder's conftest.py"
    assert os.path.isfile(os.path.join(ROOT, "tests", "__init__.py"))
    assert os.path.isfile(os.path.join(ROOT, HELPERS, "__init__.py"))


def test_the_data_pipeline_tests_follow_its_stages():
    """tests/data_pipeline/ has a folder per stage of data_pipeline/ (tests/data_pipeline/records/ tests
    data_pipeline/records/), each of 1..12 test modules; beside the folders only conftest.py and the tests of
    a module at data_pipeline/'s top level (test_tf_import.py tests data_pipeline/tf_import.py)."""
    folder = os.path.join(ROOT, "tests", "data_pipeline")
    top_level = [part for part in DP_LAYER if not part.endswith("/") and part != "data_pipeline"]
    wrong = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            tests = [n for n in os.listdir(path) if n.startswith("test_") and n.endswith(".py")]
            if name != "__pycache__" and (name + "/" not in DP_LAYER or not 1 <= len(tests) <= 12):
                wrong.append(f"{name}/ ({len(tests)} test modules)")
        elif name.endswith(".py") and name != "conftest.py":
            module = name[len("test_"):-len(".py")] if name.startswith("test_") else None
            if not any(module == m or (module or "").startswith(m + "_") for m in top_level):
                wrong.append(name)
    assert not wrong, f"tests/data_pipeline/: {wrong}: a stage's tests go to the folder named for it"
