"""Summarise py-spy's raw (collapsed) stacks of ``full_eager_spy.py``: only samples inside
``decode_step``; self samples per line and per function, inclusive samples per function.
Usage: python3 spy_summary.py stacks.txt [TOP]"""
import collections, re, sys
top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
self_line, self_fn, incl = collections.Counter(), collections.Counter(), collections.Counter()
total = 0
for row in open(sys.argv[1]):
    stack, _, n = row.rstrip("\n").rpartition(" ")
    if "decode_step" not in stack:
        continue
    n = int(n)
    total += n
    frames = stack.split(";")
    leaf = frames[-1]
    self_line[leaf] += n
    strip = lambda f: re.sub(r":\d+\)$", ")", f)
    self_fn[strip(leaf)] += n
    for f in set(map(strip, frames)):
        incl[f] += n
print(f"samples in decode_step: {total}")
for title, c in (("self, by line", self_line), ("self, by function", self_fn), ("inclusive, by function", incl)):
    print(f"\n== {title}")
    for k, v in c.most_common(top):
        print(f"{100 * v / total:6.2f}%  {k}")
