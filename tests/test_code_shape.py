"""The code stays readable in pieces: no file in the package (eldr_sglang/) or the crates'
sources (rust/*/src) is over 800 lines, and no function there is over 80 lines (issue 24).
Python functions are measured with ast; Rust function bodies by brace matching after comments,
strings and char literals are blanked. A function counts from its `def`/`fn` line to its last
line, nested functions included in their parent."""

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
