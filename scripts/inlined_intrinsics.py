#!/usr/bin/env python3
"""Fails if weft's code calls a SIMD intrinsic out of line.

An intrinsic used where its kernel's target features do not reach (a closure inside an
`#[inline(always)]` kernel body is compiled without them) becomes a function call per
vector operation: the kernel gives the same bits and runs an order of magnitude slower,
which no test of results notices. A call counts when the function making it is weft's,
or a helper (a closure, `array::map`) that weft's code calls; std's feature detection
(`_xgetbv`) and other crates' one-off setup are left alone.

Usage: python3 scripts/inlined_intrinsics.py target/release/weft
"""
import collections
import re
import shutil
import subprocess
import sys

binary = sys.argv[1] if len(sys.argv) > 1 else sys.exit(__doc__)
if not shutil.which("objdump"):
    sys.exit("objdump (binutils) is needed")
listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", binary], capture_output=True, text=True, check=True)
head = re.compile(r"^([0-9a-f]+) <(.*)>:$")
call = re.compile(r"\bcall\s+([0-9a-f]+) <(.*)>$")
names, calls = {}, collections.defaultdict(list)
current = None
for line in listing.stdout.splitlines():
    if m := head.match(line):
        current = m.group(1).lstrip("0")
        names[current] = m.group(2)
    elif current and (m := call.search(line)):
        calls[current].append((m.group(1).lstrip("0"), m.group(2)))
callers = collections.defaultdict(set)
for f, targets in calls.items():
    for addr, _ in targets:
        callers[addr].add(f)


def weft(f, depth=2):
    """Whether `f` is weft's code or called from it within `depth` calls."""
    if names.get(f, "").startswith("weft::"):
        return True
    return depth > 0 and any(weft(c, depth - 1) for c in callers[f])


bad = collections.Counter()
for f, targets in calls.items():
    for _, target in targets:
        if target.startswith("core::core_arch::") and "_xgetbv" not in target and weft(f):
            bad[(names[f], target)] += 1
for (f, target), n in sorted(bad.items()):
    print(f"{n:4} {f} -> {target}", file=sys.stderr)
if bad:
    sys.exit("SIMD intrinsics called out of line, not inlined into their kernels (above)")
print("every SIMD intrinsic in weft's code is inlined")
