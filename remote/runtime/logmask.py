"""Copies a stage's output into the run log with secret values replaced by ``****``.

``python logmask.py ENV_FILE NAME...``: reads the values of the named variables from the run's env
file (the secrets passed through from the workstation) and masks them in every line from stdin, so
a token that a library prints (a URL with credentials, a debug dump of os.environ) never reaches
run.log, and so never the workstation either. Stdlib only.
"""
import re
import shlex
import sys

MASK = b"****"


def secret_values(env_file, names):
    values = []
    with open(env_file) as f:
        for line in f:
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
            if m and m.group(1) in names:
                words = shlex.split(m.group(2))
                if words and words[0]:
                    values.append(words[0].encode())
    return sorted(set(values), key=len, reverse=True)


def main(argv):
    values = secret_values(argv[1], set(argv[2:])) if len(argv) > 2 else []
    out = sys.stdout.buffer
    for line in iter(lambda: sys.stdin.buffer.readline(1 << 16), b""):
        for v in values:
            line = line.replace(v, MASK)
        out.write(line)
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
