#!/usr/bin/env python3
"""The one-way house (docs/CONVENTIONS.md, "Structure"): a source file may include headers of its
own folder and of the folders beneath it, never of one above. Run over the tree:

    tests/layering/check_layering.py ROOT        exit 1 listing every include that runs up
    tests/layering/check_layering.py --self-test  the checker against a tree it makes

The order below is the design's (../shared/DESIGN.md): kernels <- placement <- worker <-
coordinator <- launch, transport beside placement, and coordinator/ in its rooms, each of
which sees only the rooms before it.
"""
import os
import re
import sys
import tempfile

# Each folder with the folders it may include from (its own is always allowed).
BELOW = {
    "kernels": [],
    "placement": ["kernels"],
    "transport": ["kernels"],
    "worker": ["kernels", "placement", "transport"],
    "coordinator/intake": ["kernels", "placement", "transport", "worker"],
    "coordinator/plan": ["kernels", "placement", "transport", "worker", "coordinator/intake"],
    "coordinator/s3": ["kernels", "placement", "transport", "worker", "coordinator/intake",
                       "coordinator/plan"],
    "coordinator/exegpt": ["kernels", "placement", "transport", "worker", "coordinator/intake",
                           "coordinator/plan", "coordinator/s3"],
    "coordinator/run": ["kernels", "placement", "transport", "worker", "coordinator/intake",
                        "coordinator/plan", "coordinator/s3", "coordinator/exegpt"],
    "launch": ["kernels", "placement", "transport", "worker", "coordinator/intake",
               "coordinator/plan", "coordinator/s3", "coordinator/exegpt", "coordinator/run"],
}
SOURCES = (".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def folder_of(path):
    """The layered folder a repository path belongs to, or None (tests/, scripts/, ...)."""
    for folder in sorted(BELOW, key=len, reverse=True):
        if path == folder or path.startswith(folder + "/"):
            return folder
    return None


def violations(root):
    found = []
    for top in ("kernels", "placement", "transport", "worker", "coordinator", "launch"):
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.relpath(os.path.join(dirpath, name), root)
                here = folder_of(path)
                if here is None:
                    found.append(f"{path}: in no room of the house (coordinator/ holds only "
                                 f"{', '.join(f for f in BELOW if f.startswith('coordinator/'))})")
                    continue
                with open(os.path.join(root, path), encoding="utf-8") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m or "/" not in m.group(1):
                            continue  # a system header, or one beside the file
                        there = folder_of(m.group(1))
                        if there is None or there == here or there in BELOW[here]:
                            continue
                        found.append(f"{path}:{lineno}: {here} includes {m.group(1)} from "
                                     f"{there}, which is not beneath it")
    return found


def self_test():
    """The checker must flag an include that runs up and pass one that runs down."""
    with tempfile.TemporaryDirectory() as root:
        def write(path, text):
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(text)
        write("kernels/a.h", "#pragma once\n")
        write("coordinator/s3/p.h", '#include "coordinator/plan/q.h"\n#include "kernels/a.h"\n')
        write("coordinator/plan/q.h", "#pragma once\n")
        if violations(root):
            return "a downward include was flagged: " + "; ".join(violations(root))
        write("coordinator/plan/q.cpp", '#include "coordinator/s3/p.h"\n')
        write("kernels/b.cpp", '#include "worker/w.h"\n')
        write("coordinator/stray.h", "#pragma once\n")
        got = violations(root)
        want = ["coordinator/plan/q.cpp:1", "kernels/b.cpp:1", "coordinator/stray.h"]
        missing = [w for w in want if not any(g.startswith(w) for g in got)]
        if missing or len(got) != len(want):
            return f"expected exactly {want}, got {got}"
    return None


def main():
    if sys.argv[1:] == ["--self-test"]:
        error = self_test()
        print(error or "layering self-test: an upward include and a stray file flagged")
        return 1 if error else 0
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = violations(sys.argv[1])
    for v in found:
        print(v)
    print(f"{len(found)} include(s) running up the house")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
