"""Reads the hop timings in a log (see cuda-lease/src/hops.rs).

Two kinds of line carry them:
  - a hop span as the `cuda_lease::hop` layer prints it when it closes,
    `NAME{at_us=T phase_us=N ... op=OP bytes=B}: close` (perhaps after its
    parent spans, `parent{...}:NAME{...}: close`);
  - a line a program prints with `hops::emit`, and the lines of logs from
    before the spans, `hop=NAME op=OP bytes=B at_us=T phase_us=N ...`.

`records(path)` yields one (hop, op, bytes, at_us, phases) per line, phases
being the `*_us` fields other than `at_us`, in their order on the line."""
import re

_SPAN = re.compile(r"([\w.-]+)\{([^{}]*)\}: close\b")
_EMIT = re.compile(r"\bhop=(\S+)((?: \w+=\S+)*)")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_line(line):
    """The (hop, op, bytes, at_us, phases) of a line, or None."""
    m = _SPAN.search(line)
    if m:
        hop, body = m.group(1), m.group(2)
    else:
        m = _EMIT.search(line)
        if not m:
            return None
        hop, body = m.group(1), m.group(2)
    fields = _FIELD.findall(body)
    values = dict(fields)
    if "at_us" not in values:
        return None
    phases = [(k[:-3], int(v)) for k, v in fields
              if k.endswith("_us") and k != "at_us" and v.isdigit()]
    nbytes = values.get("bytes", "0")
    return (hop, values.get("op", "-"),
            int(nbytes) if nbytes.isdigit() else 0,
            int(values["at_us"]), phases)


def records(path):
    """The hop records of the log at `path`, in the log's order."""
    with open(path, errors="replace") as f:
        for line in f:
            r = parse_line(line)
            if r:
                yield r
