#!/usr/bin/env python3
"""Every relative link in the manual resolves: README.md and docs/**/*.md.

    tests/docs/check_links.py ROOT         exit 1 listing every link that does not resolve
    tests/docs/check_links.py --self-test  the checker against a tree it makes

A link resolves when the file (or folder) it names exists, relative to the page that holds
it, and, for `page.md#anchor` or `#anchor`, when that page has a heading with the anchor
GitHub gives it: the heading's text lowercased, spaces turned into '-', punctuation
dropped, and a repeated heading numbered -1, -2, ... External links (any `scheme:`) are not
fetched: the test runs without a network. Links inside code (fenced blocks, `spans`) are
not links. Citations of docs in code comments are not checked here.
"""
import os
import re
import sys
import tempfile
import urllib.parse

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages(root):
    """README.md and every Markdown file under docs/, as paths relative to root."""
    found = ["README.md"] if os.path.isfile(os.path.join(root, "README.md")) else []
    for folder, _, files in os.walk(os.path.join(root, "docs")):
        for name in sorted(files):
            if name.endswith(".md"):
                found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


def prose_lines(text):
    """(line number, line) of each line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def anchors(text):
    """Every anchor a page defines: its headings' slugs, numbered when repeated, and <a id>."""
    seen = {}
    found = set()
    for _, line in prose_lines(text):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text):
    """(line number, target) of every link in the page's prose."""
    for number, line in prose_lines(text):
        line = CODE_SPAN.sub("", line)
        targets = [m.group(1) for m in INLINE.finditer(line)]
        m = REFERENCE.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            yield number, target.strip("<>")


def broken(root):
    """'page:line: target: why' for each link of the manual that does not resolve."""
    problems = []
    cache = {}

    def anchors_of(path):
        if path not in cache:
            with open(path, encoding="utf-8") as f:
                cache[path] = anchors(f.read())
        return cache[path]

    for page in pages(root):
        page_path = os.path.join(root, page)
        with open(page_path, encoding="utf-8") as f:
            text = f.read()
        for number, target in links(text):
            if SCHEME.match(target):
                continue
            path, _, anchor = target.partition("#")
            path = urllib.parse.unquote(path)
            resolved = page_path
            if path:
                resolved = os.path.normpath(os.path.join(os.path.dirname(page_path), path))
            where = f"{page}:{number}: {target}"
            if path and not os.path.exists(resolved):
                problems.append(f"{where}: no such file")
            elif anchor and (not path or resolved.endswith(".md")):
                if urllib.parse.unquote(anchor) not in anchors_of(resolved):
                    problems.append(f"{where}: no heading with this anchor")
    return problems


def self_test():
    """The checker flags a missing file and a missing heading, and nothing else."""
    with tempfile.TemporaryDirectory() as root:

        def write(path, text):
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(text)

        write("README.md", "See [the index](docs/README.md) and [b](docs/b.md#a-heading-2).\n")
        write("docs/README.md",
              "# Index\n[a](a.md), [gone](missing.md), [web](https://example.com/x.md),\n"
              "[top](#index), [bad](b.md#no-such-heading), [plot](plots/p.png)\n"
              "```\n[in a fence](fenced.md)\n```\n`[in a span](span.md)`\n"
              "[ref]: journal/old.md\n")
        write("docs/a.md", "# A\n")
        write("docs/b.md", "# A heading: 2\n## `Code` and a [link](a.md), ×2!\n")
        write("docs/plots/p.png", "")
        write("docs/journal/old.md", "# Old\n[up](../b.md#code-and-a-link-2)\n")
        found = broken(root)
        expected = ["docs/README.md:2: missing.md: no such file",
                    "docs/README.md:3: b.md#no-such-heading: no heading with this anchor"]
        if found != expected:
            return f"expected {expected}, found {found}"
        if slug("A heading, again") != "a-heading-again" or "a-1" not in anchors("# A\n# A\n"):
            return "GitHub's anchor rule is not followed"
    return None


def main():
    if sys.argv[1:] == ["--self-test"]:
        error = self_test()
        print(error or "self-test: a missing file and a missing heading are both flagged")
        return 1 if error else 0
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    problems = broken(sys.argv[1])
    for p in problems:
        print(p)
    print(f"{len(problems)} broken links in {len(pages(sys.argv[1]))} pages")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
