"""The code stays readable in pieces (issue 24): no file in the package (eldr_sglang/) or the
crates' sources (rust/*/src) is over 800 lines, no function there is over 80 lines, and no
two modules of a crate import each other, directly or round a loop.
Python functions are measured with ast; Rust function bodies by brace matching after comments,
strings and char literals are blanked. A function counts from its `def`/`fn` line to its last
line, nested functions included in their parent. Python imports are every import statement
of a module (inside functions and TYPE_CHECKING blocks too: a loop put off is still a loop);
Rust imports are read from `use` trees and
`crate::`/`super::`/`self::` paths, test modules left out; a module reading its own parent
or the crate root (a trait the parent defines, a re-export) is the module tree, not a loop."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 800
MAX_FN_LINES = 80


def _python_files():
    return sorted((ROOT / "eldr_sglang").rglob("*.py"))


def _rust_files():
    return sorted(p for src in (ROOT / "rust").glob("*/src") for p in src.rglob("*.rs"))


def _python_functions(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def _blank_rust(text: str) -> str:
    """Replace comments, string and char literals by spaces, newlines kept, so braces inside
    them do not count and line numbers stay true."""
    out, i, n = [], 0, len(text)

    def blank(s):
        return re.sub(r"[^\n]", " ", s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):  # Rust block comments nest
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append(blank(text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(blank(text[i:j + 1]))
            i = j + 1
        elif c == "'":
            # a char literal ('a', '\n', '\u{1F600}', '{') and not a lifetime ('a)
            m = re.compile(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'").match(text, i)
            if m:
                out.append(blank(m.group(0)))
                i = m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


_FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")


def _rust_functions(path: Path):
    text = _blank_rust(path.read_text())
    for m in _FN.finditer(text):
        # the body opens at the first `{` after the signature; a `;` first means no body
        j = m.end()
        depth_paren = 0
        while j < len(text):
            ch = text[j]
            if ch in "(<[":
                depth_paren += 1
            elif ch in ")]" or (ch == ">" and text[j - 1] not in "-="):  # `->` is no bracket
                depth_paren -= 1
            elif ch == ";" and depth_paren <= 0:
                j = -1
                break
            elif ch == "{" and depth_paren <= 0:
                break
            j += 1
        if j < 0 or j >= len(text):
            continue
        depth, k = 0, j
        while k < len(text):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        first = text.count("\n", 0, m.start()) + 1
        last = text.count("\n", 0, k) + 1
        yield m.group(1), first, last - first + 1


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_rust_scanner_reads_bodies_braces_in_literals_aside():
    src = ('fn a() -> Vec<u8> {\n    let s = "}{";\n    let c = \'{\';\n    // }\n'
           '    let r = r#"}"#;\n    /* } /* } */ */\n    b::<\'static>()\n}\n'
           'trait T { fn decl(&self); }\nfn two() -> [u8; 2] { if x { y } }\n')
    p = ROOT / "tests" / "_shape_probe.rs"
    try:
        p.write_text(src)
        assert list(_rust_functions(p)) == [("a", 1, 8), ("two", 10, 1)]
    finally:
        p.unlink()


def test_no_file_over_800_lines():
    long = [f"{_rel(p)}: {n}" for p in _python_files() + _rust_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("lang", ["python", "rust"])
def test_no_function_over_80_lines(lang):
    files, scan = (_python_files(), _python_functions) if lang == "python" else (_rust_files(), _rust_functions)
    long = [f"{_rel(p)}:{line} {name} ({n} lines)" for p in files for name, line, n in scan(p) if n > MAX_FN_LINES]
    assert not long, f"{lang} functions over {MAX_FN_LINES} lines:\n" + "\n".join(long)


def _rust_modules(src: Path) -> dict[tuple, Path]:
    """Module path (('flow', 'decode'), () for the crate root) -> its file; test files left out."""
    mods = {}
    for p in src.rglob("*.rs"):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "tests":
            continue
        if parts[-1] in ("lib", "main", "mod"):
            parts = parts[:-1]
        mods[tuple(parts)] = p
    return mods


def _strip_test_modules(text: str) -> str:
    """Blank `#[cfg(test)] mod NAME { ... }` blocks (their `use super::*` is no import)."""
    for m in reversed(list(re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text))):
        depth, k = 0, m.end() - 1
        while k < len(text):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                break
            k += 1
        text = text[:m.start()] + re.sub(r"[^\n]", " ", text[m.start():k + 1]) + text[k + 1:]
    return text


def _use_paths(text: str) -> list[str]:
    """Every path a `use` tree names, flattened (`a::{b, c::{d}}` -> a::b, a::c::d), and every
    inline `crate::`/`super::`/`self::` path."""
    def flat(tree: str, prefix: str = "") -> list[str]:
        tree = tree.strip()
        i = tree.find("{")
        if i < 0:
            return [prefix + re.sub(r"\s+as\s+\w+$", "", tree)] if tree else []
        head, inner, parts, depth, cur = tree[:i], tree[i + 1:tree.rfind("}")], [], 0, ""
        for ch in inner:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        return [q for part in parts for q in flat(part, prefix + head)]

    paths = [q for m in re.finditer(r"\buse\s+([^;]+);", text) for q in flat(m.group(1))]
    return paths + re.findall(r"\b(?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+", text)


def _rust_imports(src: Path) -> dict[tuple, set]:
    mods = _rust_modules(src)
    graph: dict[tuple, set] = {}
    for mod, p in mods.items():
        deps = set()
        for path in _use_paths(_strip_test_modules(_blank_rust(p.read_text()))):
            segs = [x for x in path.replace(" ", "").split("::") if x]
            if not segs:
                continue
            if segs[0] == "crate":
                base, segs = [], segs[1:]
            elif segs[0] in ("super", "self"):
                base = list(mod)
                while segs and segs[0] in ("super", "self"):
                    base = base[:-1] if segs[0] == "super" else base
                    segs = segs[1:]
            elif mod + (segs[0],) in mods:  # a child module by its bare name
                base = list(mod)
            else:
                continue  # another crate or std
            target = max((tuple(base + segs[:k]) for k in range(len(segs) + 1) if tuple(base + segs[:k]) in mods), key=len, default=())
            if target != mod and target != mod[:len(target)]:  # not itself, not an ancestor
                deps.add(target)
        graph[mod] = deps
    return graph


def _loops(graph: dict) -> list[list]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    out: list = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_import_reader_sees_a_loop_between_siblings():
    src = ROOT / "tests" / "_shape_probe_crate"
    try:
        (src / "flow").mkdir(parents=True)
        (src / "lib.rs").write_text("pub mod flow;\npub use flow::decode::Ctx;\n")
        (src / "flow" / "mod.rs").write_text("pub mod decode;\npub mod pump;\n#[cfg(test)]\nmod tests { use super::*; }\n")
        (src / "flow" / "decode.rs").write_text("use super::pump::{pump, Timing};\nuse crate::Ctx;\n")
        (src / "flow" / "pump.rs").write_text("fn f(c: &super::decode::Ctx) {}\n")
        assert _loops(_rust_imports(src)) == [[("flow", "decode"), ("flow", "pump")]]
        (src / "flow" / "pump.rs").write_text("use crate::flow::{self};\n")
        assert _loops(_rust_imports(src)) == []
    finally:
        for p in sorted(src.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        src.rmdir()


def test_no_import_loops_in_the_crates():
    found = [f"{src.parent.name}: " + " <-> ".join("::".join(m) for m in comp)
             for src in sorted((ROOT / "rust").glob("*/src")) for comp in _loops(_rust_imports(src))]
    assert not found, "modules that import each other:\n" + "\n".join(found)


def _python_imports() -> dict[str, set]:
    root = ROOT / "eldr_sglang"
    names = {}
    for p in _python_files():
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = p
    graph: dict[str, set] = {}
    for mod, p in names.items():
        package = mod if p.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in names:  # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != mod and not mod.startswith(t + "."):  # not itself, not a parent package
                    deps.add(t)
        graph[mod] = deps
    assert root.exists() and graph
    return graph


def test_no_import_loops_in_the_package():
    found = [" <-> ".join(comp) for comp in _loops(_python_imports())]
    assert not found, "modules that import each other:\n" + "\n".join(found)
