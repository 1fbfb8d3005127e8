# The shape of the tree: the stages on top, every other module one level down in a package named for the stage it
# serves, imports that run down the floors and never in a circle, and the README's layout table naming exactly the
# modules that are there. Read from the sources with ast (every import, lazy ones inside functions included).
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engines", "wires", "trainer", "agents")
SHARED = {"invariants", "data", "models"}          # what every floor may import


def modules() -> dict[str, str]:
    """Every module of the framework (recipes, tests and bench aside) by dotted name -> its path."""
    found = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    for package in PACKAGES:
        for f in os.listdir(os.path.join(ROOT, package)):
            if f.endswith(".py"):
                found[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(ROOT, package, f)
    return found


def imports(path: str, known: set[str]) -> set[str]:
    """The framework modules a file imports, anywhere in it (`from engines import r3` is engines.r3)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return out


def floor(name: str) -> str:
    return "shared" if name in SHARED else "package" if "." in name or name in PACKAGES else "stage"


def test_the_top_level_holds_the_stages_and_the_shared_modules_alone():
    top = sorted(m for m in modules() if "." not in m and m not in PACKAGES)
    assert top == sorted(["invariants", "data", "models", "config", "rollout", "router", "session", "loopback",
                          "algo", "actor", "critic", "runtime", "train"])


def test_a_package_module_imports_only_the_shared_modules_and_packages():
    known = modules()
    upward = {name: sorted(m for m in imports(path, set(known)) if floor(m) == "stage")
              for name, path in known.items() if "." in name or name in ("engines", "wires")}
    assert {name: up for name, up in upward.items() if up} == {}
    # the trap is armed: a stage's own imports do name stages (session.py reads router.Router)
    assert "router" in imports(known["session"], set(known))


def test_no_module_imports_itself_back_through_others():
    known = modules()
    graph = {name: imports(path, set(known)) - {name} for name, path in known.items()}
    # a package's __init__ is imported by each of its modules on the way in: that edge is Python's, not ours
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    state: dict[str, int] = {}
    circle: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                circle.extend(path[path.index(dep):] + [dep] if dep in path else [name, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circle == []


def test_the_readme_layout_table_names_every_module_and_no_other():
    readme = open(os.path.join(ROOT, "README.md")).read()
    layout = readme[readme.index("## Layout"):readme.index("## The three invariants")]
    named = set(re.findall(r"`(\w+)\.py`", layout))
    top = {m for m in modules() if "." not in m and m not in PACKAGES}
    assert top <= named, f"top-level modules missing from the README's layout table: {sorted(top - named)}"
    for package in ("engines", "wires", "trainer"):
        row = next(line for line in layout.splitlines() if line.startswith(f"| `{package}/`")).split(" | ")[-1]
        inside = {f[:-3] for f in os.listdir(os.path.join(ROOT, package)) if f.endswith(".py")}
        named_here = set(re.findall(r"`(\w+)\.py`", row))
        assert inside - {"__init__"} <= named_here <= inside, package
