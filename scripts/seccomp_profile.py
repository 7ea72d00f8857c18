#!/usr/bin/env python3
"""Sorts the system calls of traced ferrovm threads into roles (see seccomp-profile.sh).

usage: seccomp_profile.py OUT PROFILES_DIR
OUT/traces/*/t.TID are `strace -f -ff` outputs. A ferrovm process is one whose trace holds a
successful execve of a file named ferrovm; its threads are those it (transitively) created
with CLONE_THREAD. A thread's role comes from its name (PR_SET_NAME, `main` for the first
thread); what it calls after its own seccomp() belongs to its role, what it calls between
its creation and its seccomp() runs under the launcher's filter and belongs to the launcher.
"""

import collections
import os
import re
import sys

# Thread name -> role, in order; the first match wins.
ROLES = [
    (r"main", "main"),
    (r"launcher", "launcher"),
    (r"vcpu\d+", "vcpu"),
    (r"virtio-.*|serial-out", "device-io"),
    (r"api|api-request", "api"),
    (r"migration", "migration"),
    (r"timers|throttle", "timer"),
    (r"snapshot-verify", "restore-verify"),
    (r"snapshot-(faults|prefetch-[0-9]+)", "restore-faults"),
    (r"uffd.*|restore-fault.*", "restore-faults"),
    (r"serial-in.*", "serial-input"),
]
# Calls whose profile lines name one argument's value: the argument's index.
KEYED = {"ioctl": 1, "fcntl": 1, "madvise": 2, "prctl": 0, "socket": 0}

CALL = re.compile(r"^([a-z_0-9]+)\((.*)")
RESULT = re.compile(r"=\s+(-?\d+)(?:\s|$)")


def role_of(name):
    for pattern, role in ROLES:
        if re.fullmatch(pattern, name):
            return role
    return "unknown:" + name


def split_args(text):
    """Top-level comma-separated arguments of a strace call (up to the closing paren)."""
    args, depth, cur, quoted = [], 0, "", False
    for i, c in enumerate(text):
        if quoted:
            cur += c
            if c == '"' and text[i - 1] != "\\":
                quoted = False
            continue
        if c == '"':
            quoted = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif c == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        cur += c
    args.append(cur.strip())
    return args


def entry(name, rest):
    """The profile line for one call: `name` or `name VALUE`."""
    if name not in KEYED:
        return name
    args = split_args(rest)
    index = KEYED[name]
    if index >= len(args):
        return name
    # ioctl(3, KVM_RUN, 0), madvise(..., MADV_DONTNEED), socket(AF_UNIX, ...); a call cut
    # short by the process's end reads `KVM_RUN <unfinished ...>`.
    value = re.match(r"[^\s|]*", args[index]).group(0)
    return f"{name} {value}" if value else name


def read_traces(root):
    """{(suite, tid): [lines]}"""
    traces = {}
    for suite in sorted(os.listdir(root)):
        d = os.path.join(root, suite)
        for f in os.listdir(d):
            if f.startswith("t."):
                with open(os.path.join(d, f), errors="replace") as fh:
                    traces[(suite, int(f[2:]))] = fh.read().splitlines()
    return traces


def threads_of_ferrovm(traces):
    """{(suite, tid): first line index that is ferrovm's} for every ferrovm thread."""
    children = collections.defaultdict(list)
    starts = {}
    for (suite, tid), lines in traces.items():
        for i, line in enumerate(lines):
            if line.startswith(("clone(", "clone3(")) and "CLONE_THREAD" in line:
                m = RESULT.search(line.rsplit(")", 1)[-1]) or RESULT.search(line)
                if m and int(m.group(1)) > 0:
                    children[(suite, tid)].append((suite, int(m.group(1))))
            elif line.startswith("execve(") and re.search(r'/ferrovm"', line) and "= 0" in line:
                starts[(suite, tid)] = i + 1
    found = {}
    todo = list(starts.items())
    while todo:
        key, first = todo.pop()
        found[key] = first
        todo.extend((child, 0) for child in children[key] if child not in found)
    return found, starts


def thread_name(lines, is_main):
    if is_main:
        return "main"
    for line in lines:
        m = re.match(r'prctl\(PR_SET_NAME, "([^"]*)"', line)
        if m:
            return m.group(1)
    return "unnamed"


def classify(traces):
    """{role: {entry: count}}, unknown thread names reported as roles `unknown:NAME`."""
    seen = collections.defaultdict(collections.Counter)
    found, mains = threads_of_ferrovm(traces)
    for key, first in found.items():
        lines = traces[key][first:]
        name = thread_name(lines, key in mains)
        role = role_of(name)
        installs = [i for i, l in enumerate(lines) if l.startswith("seccomp(SECCOMP_SET_MODE_FILTER")]
        own_from = installs[-1] + 1 if installs else None
        for i, line in enumerate(lines):
            m = CALL.match(line)
            if not m:
                continue
            if own_from is None or i < own_from:
                # Unfiltered (main and the launcher before their own filter, or a run without
                # filters) or under the launcher's filter (any other thread before its own).
                if role in ("main", "launcher") or own_from is None:
                    continue
                target = "launcher"
            else:
                target = role
            seen[target][entry(m.group(1), m.group(2))] += 1
    return seen


def profile_lines(path):
    lines = set()
    if os.path.exists(path):
        for raw in open(path):
            line = raw.split("#")[0].strip()
            if line:
                lines.add(" ".join(line.split()))
    return lines


def allowed(entry_text, profile):
    name = entry_text.split()[0]
    return entry_text in profile or name in profile


def main():
    out, profiles = sys.argv[1], sys.argv[2]
    seen = classify(read_traces(os.path.join(out, "traces")))
    common = profile_lines(os.path.join(profiles, "common.txt"))
    os.makedirs(os.path.join(out, "seen"), exist_ok=True)
    problems = 0
    for role in sorted(seen):
        calls = seen[role]
        with open(os.path.join(out, "seen", role + ".txt"), "w") as fh:
            fh.write("".join(f"{c}  # {n}\n" for c, n in sorted(calls.items())))
        own = profile_lines(os.path.join(profiles, role + ".txt"))
        missing = sorted(c for c in calls if not allowed(c, own | common))
        unseen = sorted(c for c in own if c not in calls and c.split()[0] not in calls)
        print(f"{role}: {len(calls)} distinct calls seen")
        for c in missing:
            print(f"  missing  {c}  ({calls[c]}x)")
        for c in unseen:
            print(f"  unseen   {c}")
        problems += len(missing) + role.startswith("unknown:")
    print(f"lists written to {out}/seen/; {problems} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
