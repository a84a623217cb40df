"""Regenerate qwen2om/data/cann-onnx-ops.json from CANN's open-source repositories.

The table lists every ONNX origin type CANN's parser plugins register (`REGISTER_CUSTOM_OP(...)
.FrameworkType(ONNX).OriginOpType(...)`, and the one macro in ops-math's similar_opp_onnx_plugin.cpp
that expands to the same), with the GE op, the opsets and file@commit#line of each registration.
The per-op constraints (`_constraints`) were read from the plugin code by hand; this script keeps
their text and recomputes each one's line from its anchor (a regex in the file it cites), so a
moved line follows and a vanished anchor is reported for a person to re-read.

    git clone https://gitcode.com/cann/ops-math   # or a mirror of hicann/ops-math; likewise the others
    python tools/cann_table.py --repo hicann/ops-math=../ops-math --repo hicann/ops-nn=../ops-nn \\
        --repo hicann/ops-cv=../ops-cv --repo hicann/ge=../ge -o qwen2om/data/cann-onnx-ops.json

Each repository is read at the commit the current table records (`_meta.repos`, `_meta.parser`),
so the command above reproduces the shipped table; `--rev hicann/ops-math=<commit>` (or `HEAD`)
reads another commit and records it. Bare clones work: files are read with `git show`. Repositories
not given (yuanfang-chen/ops-transformer, whose files were read one by one) keep their entries;
any repository given that is not the parser's (`_meta.parser_repos`) is read for registrations.
`--check` compares instead of writing and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BASE = Path(__file__).resolve().parent.parent / "qwen2om" / "data" / "cann-onnx-ops.json"
KEY = re.compile(r"^([A-Za-z0-9_.]+)::(\d+)::([A-Za-z0-9_]+)$")  # what ConstructOriType builds
REGISTER = re.compile(r"REGISTER_CUSTOM_OP\(\s*\"([^\"]+)\"\s*\)")
MACRO = re.compile(r"#define\s+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)+[^\n]*)")
STRING = re.compile(r"\"((?:[^\"\\]|\\.)*)\"")


@dataclasses.dataclass(frozen=True)
class Registration:
    """One origin type string registered for one GE op, and where."""

    origin: str
    ge_op: str
    repo: str
    path: str
    commit: str
    line: int

    @property
    def file(self) -> str:
        return f"{self.repo}:{self.path}@{self.commit}"


class Repo:
    """A git directory (bare or not) read at one commit."""

    def __init__(self, name: str, git_dir: Path, commit: str) -> None:
        self.name, self.git_dir = name, git_dir
        self.commit = self.git("rev-parse", f"{commit}^{{commit}}").strip()

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.git_dir), *args], check=True, capture_output=True,
                              text=True).stdout

    def files(self, pattern: str) -> list[str]:
        """Paths at the commit whose text matches `pattern` (git grep -l)."""
        try:
            out = self.git("grep", "-l", "-E", pattern, self.commit)
        except subprocess.CalledProcessError:  # git grep exits 1 when nothing matches
            return []
        return sorted(line.split(":", 1)[1] for line in out.splitlines())

    def show(self, path: str) -> str:
        return self.git("show", f"{self.commit}:{path}")


def statement_end(text: str, start: int) -> int:
    """Index of the `;` closing the statement that starts at `start` (strings and parens skipped)."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            i = STRING.match(text, i).end()  # type: ignore[union-attr]
            continue
        depth += c == "("
        depth -= c == ")"
        if c == ";" and depth == 0:
            return i
        i += 1
    return len(text)


def origin_args(statement: str) -> list[str]:
    """The string literals inside `.OriginOpType(...)` of one registration statement."""
    at = statement.find(".OriginOpType(")
    if at < 0:
        return []
    depth, i = 0, at + len(".OriginOpType")
    for i in range(at + len(".OriginOpType"), len(statement)):
        depth += statement[i] == "("
        depth -= statement[i] == ")"
        if depth == 0:
            break
    return STRING.findall(statement[at:i])


def line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def direct(repo: Repo, path: str, text: str) -> list[Registration]:
    """REGISTER_CUSTOM_OP("Ge").FrameworkType(ONNX).OriginOpType(...) statements."""
    found = []
    for m in REGISTER.finditer(text):
        statement = text[m.start():statement_end(text, m.start())]
        if ".FrameworkType(ONNX)" not in statement.replace(" ", "").replace("\n", ""):
            continue
        found += [Registration(o, m.group(1), repo.name, path, repo.commit, line_of(text, m.start()))
                  for o in origin_args(statement)]
    return found


def stringify(arg: str) -> str:
    """What the preprocessor's `#` makes of a macro argument: ends trimmed, inner whitespace one space.
    That is how clang-format's 'ai.onnx::11 ::Add' once unregistered Add (see _constraints.history)."""
    return re.sub(r"\s+", " ", arg.strip())


def through_macros(repo: Repo, path: str, text: str) -> list[Registration]:
    """Calls of a macro whose body is an ONNX registration with `#PARAM` as origin and GE op."""
    found = []
    for macro in MACRO.finditer(text):
        name, params, body = macro.group(1), [p.strip() for p in macro.group(2).split(",")], macro.group(3)
        origin = re.search(r"\.OriginOpType\(\s*#(\w+)\s*\)", body)
        ge_op = re.search(r"REGISTER_CUSTOM_OP\(\s*#(\w+)\s*\)", body)
        if not (origin and ge_op and "FrameworkType(ONNX)" in body):
            continue
        call = re.compile(rf"^\s*{name}\(([^)]*)\)", re.M)
        for c in call.finditer(text, macro.end()):
            args = dict(zip(params, c.group(1).split(","), strict=False))
            found.append(Registration(stringify(args[origin.group(1)]), stringify(args[ge_op.group(1)]), repo.name,
                                      path, repo.commit, line_of(text, c.start(1))))
    return found


def registrations(repo: Repo) -> list[Registration]:
    found = []
    for path in repo.files(r"FrameworkType\(ONNX\)"):
        text = repo.show(path)
        found += direct(repo, path, text) + through_macros(repo, path, text)
    return found


# -- the table ----------------------------------------------------------------------------------------
def entry(regs: list[Registration]) -> dict[str, Any]:
    """One op's entry, in the shipped table's form."""
    by_ge: dict[str, set[int]] = defaultdict(set)
    for r in regs:
        by_ge[r.ge_op].add(int(KEY.match(r.origin).group(2)))  # type: ignore[union-attr]
    opsets = sorted(set().union(*by_ge.values()))
    out: dict[str, Any] = {"opsets": opsets, "ge_op": " | ".join(by_ge),
                           "source": "; ".join(sorted({r.file for r in regs}))}
    if len(by_ge) > 1:
        out["ge_op_by_opset"] = {ge: sorted(v) for ge, v in by_ge.items()}
    out["lines"] = sorted({f"{r.file}#L{r.line}" for r in regs})
    return out


def build_ops(regs: list[Registration]) -> tuple[dict[str, dict[str, list[Registration]]], list[Registration]]:
    """(domain → op → registrations, registrations whose origin no parser key can match)."""
    ops: dict[str, dict[str, list[Registration]]] = defaultdict(lambda: defaultdict(list))
    odd = []
    for r in regs:
        m = KEY.match(r.origin)
        if m is None:
            odd.append(r)
        else:
            ops[m.group(1)][m.group(3)].append(r)
    return ops, odd


def anchored_lines(constraint: dict[str, Any], repos: dict[str, Repo], stale: list[str], key: str) -> None:
    """Recompute `lines` from `anchors` (fact → {repo, path, pattern}) for the repositories read."""
    for fact, a in constraint.get("anchors", {}).items():
        repo = repos.get(a["repo"])
        if repo is None:
            continue
        try:
            text = repo.show(a["path"])
        except subprocess.CalledProcessError:
            text = ""
        m = re.search(a["pattern"], text, re.M)
        if m is None:
            stale.append(f"{key}.{fact}: /{a['pattern']}/ not in {a['repo']}:{a['path']}@{repo.commit[:12]}")
            continue
        constraint.setdefault("lines", {})[fact] = f"{a['repo']}:{a['path']}@{repo.commit}#L{line_of(text, m.start())}"


def regenerate(base: dict[str, Any], repos: dict[str, Repo]) -> tuple[dict[str, Any], list[str]]:
    """The new table: registrations from `repos`, the rest of `base` kept; and the stale anchors."""
    read = {name for name in repos if name not in base["_meta"].get("parser_repos", {})}  # plugin repositories
    ops, odd = build_ops([r for name in sorted(read) for r in registrations(repos[name])])

    def kept(e: dict[str, Any]) -> bool:  # an entry from a repository not read this time stays as it was
        return not any(e.get("source", "").startswith(f"{name}:") for name in read)

    table: dict[str, Any] = {"_meta": json.loads(json.dumps(base["_meta"]))}
    for name, repo in repos.items():  # the commits read are the table's provenance
        group = "repos" if name in read else "parser_repos"
        table["_meta"].setdefault(group, {})[name] = repo.commit
    top = {op: e for op, e in base.items() if not op.startswith("_") and kept(e)}
    top.update({op: entry(regs) for op, regs in ops.pop("ai.onnx", {}).items()})
    table.update(sorted(top.items()))
    other = {d: {op: e for op, e in v.items() if kept(e)} for d, v in base["_other_domains"].items()}
    for domain, by_op in ops.items():
        other.setdefault(domain, {}).update({op: entry(regs) for op, regs in by_op.items()})
    table["_other_domains"] = {d: dict(sorted(v.items())) for d, v in sorted(other.items()) if v}
    table["_non_standard_origin_types"] = [
        {"ge_op": r.ge_op, "origin": [r.origin], "source": r.file, "line": r.line} for r in odd
    ] + [o for o in base["_non_standard_origin_types"] if not any(o["source"].startswith(f"{n}:") for n in read)]
    constraints = json.loads(json.dumps(base["_constraints"]))
    stale: list[str] = []
    for group in ("parser", "ops"):
        items = constraints[group].items() if group == "ops" else ((c.get("rule", "?"), c) for c in constraints[group])
        for key, c in items:
            anchored_lines(c, repos, stale, key)
    table["_constraints"] = constraints
    table["_llm_core"] = {op: {k: table[op][k] for k in ("opsets", "ge_op", "source")} if op in table
                          else base["_llm_core"][op] for op in base["_llm_core"]}
    return table, stale


def differences(old: dict[str, Any], new: dict[str, Any], at: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{at}/{k}: only in the new table" for k in new.keys() - old.keys()]
        out += [f"{at}/{k}: only in the old table" for k in old.keys() - new.keys()]
        for k in old.keys() & new.keys():
            out += differences(old[k], new[k], f"{at}/{k}")
        return out
    return [] if old == new else [f"{at}: {json.dumps(old)[:200]} -> {json.dumps(new)[:200]}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", action="append", default=[], metavar="NAME=GIT_DIR",
                    help="a clone of hicann/ops-math, ops-nn, ops-cv, ge (bare or not)")
    ap.add_argument("--rev", action="append", default=[], metavar="NAME=COMMIT",
                    help="read NAME at COMMIT (or HEAD) instead of the commit the table records")
    ap.add_argument("--base", type=Path, default=BASE, help="the table to start from (default: the shipped one)")
    ap.add_argument("-o", "--out", type=Path, help="where to write the new table (default: --base)")
    ap.add_argument("--check", action="store_true", help="compare with --base instead of writing; 1 if they differ")
    args = ap.parse_args(argv)
    base = json.loads(args.base.read_text(encoding="utf-8"))
    recorded = {**base["_meta"]["repos"], **base["_meta"].get("parser_repos", {})}
    revs = dict(r.split("=", 1) for r in args.rev)
    repos = {}
    for spec in args.repo:
        name, path = spec.split("=", 1)
        repos[name] = Repo(name, Path(path), revs.get(name) or recorded.get(name) or "HEAD")
    table, stale = regenerate(base, repos)
    for s in stale:
        print(f"stale anchor (re-read the constraint by hand): {s}", file=sys.stderr)
    if args.check:
        diff = differences(base, table)
        print("\n".join(diff) or "identical")
        return 1 if diff else 0
    (args.out or args.base).write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
