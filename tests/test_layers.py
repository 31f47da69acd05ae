"""The import order, read from the source: every `import` and `from ... import` anywhere in a project .py file
(function bodies and other lazy imports included) is an edge of the module graph, and the graph keeps the layers.

From the top: runs/ and bench/ (may import anything below); scalerl.py; infra/ (may import the recipe modules);
the recipe modules trainer, pipeline_rl and engine; losses, sigmoid_fit and data, which import no project module.
Nothing outside tests/ imports tests/, and no project modules import each other in a cycle. A failure names each
offending file:line.
"""
import ast
import os

from conftest import ROOT

RECIPE = {"trainer", "pipeline_rl", "engine", "losses", "data", "sigmoid_fit"}
LEAVES = {"losses", "sigmoid_fit", "data"}  # import no project module


def project_files():
    """{module name: path} of every project .py file: top-level modules, infra/, runs/, bench/, tests/."""
    found = {}
    for folder in ("", "infra", "runs", "bench", "tests"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                stem = name[:-3]
                module = folder if stem == "__init__" else ".".join(filter(None, (folder, stem)))
                found[module] = os.path.join(ROOT, folder, name)
    return found


def layer(module):
    """Higher layers may import lower ones: tests 5, runs/ and bench/ 4, scalerl 3, infra 2, recipe 1, leaves 0."""
    top = module.partition(".")[0]
    return {"tests": 5, "runs": 4, "bench": 4, "scalerl": 3, "infra": 2}.get(top, 0 if module in LEAVES else 1)


def imports(path, importer, modules):
    """[(line, imported project module)] of one file: a package's submodule when the name is one, else the package;
    importing a.b also runs a (its __init__)."""
    package = importer if path.endswith("__init__.py") else importer.rpartition(".")[0]
    # tests/ is on sys.path for the tests (conftest, other test files)
    local = {m.partition(".")[2]: m for m in modules if m.startswith("tests.")} if importer.startswith("tests") else {}
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package up
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, parts + [base]))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            name = local.get(name, name)
            parts = name.split(".")
            for k in range(1, len(parts) + 1):  # a.b.c: a, a.b, a.b.c, those that are project modules
                if ".".join(parts[:k]) in modules:
                    out.append((node.lineno, ".".join(parts[:k])))
    return sorted(set(out))


def graph():
    modules = project_files()
    return modules, {m: imports(path, m, modules) for m, path in modules.items()}


def test_the_graph_sees_every_kind_of_import():
    """The parser itself: lazy, dotted, from-package and relative imports are all edges."""
    modules, edges = graph()
    assert {"data", "scalerl", "infra", "infra.sandbox", "infra.plan", "runs.ablations", "tests.conftest"} <= set(
        modules)
    run = {m for _, m in edges["infra.run"]}
    assert {"infra.plan", "infra.vllm_engine", "infra.sources", "data", "infra"} <= run  # lazy ones among them
    assert ("infra.sandbox" in {m for _, m in edges["infra.rundir"]}
            and "tests.conftest" in {m for _, m in edges["tests.test_plan"]})


def test_imports_keep_the_layers():
    modules, edges = graph()
    bad = []
    for importer, found in edges.items():
        for line, imported in found:
            where = f"{os.path.relpath(modules[importer], ROOT)}:{line} imports {imported}"
            if importer in LEAVES and imported != importer:
                bad.append(f"{where}: {importer} imports no project module")
            elif layer(imported) > layer(importer):
                bad.append(f"{where}: a lower layer imports a higher one (runs/, bench/ > scalerl > infra > "
                           f"trainer, pipeline_rl, engine > losses, sigmoid_fit, data; tests/ on top)")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    modules, edges = graph()
    state, cycles = {}, []  # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for line, imported in edges[module]:
            here = path + [f"{os.path.relpath(modules[module], ROOT)}:{line} imports {imported}"]
            if state.get(imported) == "open":
                cycles.append(" -> ".join(here[[p.split(":")[0] for p in here].index(
                    os.path.relpath(modules[imported], ROOT)):]))
            elif imported not in state:
                visit(imported, here)
        state[module] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
