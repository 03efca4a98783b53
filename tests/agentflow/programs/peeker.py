"""One turn, then what it can read of the paths given: a hidden folder's secret, a hidden file,
a file beside them, and its own working directory; and whether it can write into the framework's
code (argv: folder, file, visible, workdir, code folder)."""

import json
import os
import sys

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
folder, hidden_file, visible, workdir, code = sys.argv[1:6]


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return type(exc).__name__


with open(os.path.join(workdir, "mine.txt"), "w") as f:
    f.write("written")
result = {
    "secret": read(os.path.join(folder, "secret.txt")),
    "file": read(hidden_file),
    "visible": read(visible),
    "mine": read(os.path.join(workdir, "mine.txt")),
}
try:
    with open(os.path.join(code, "planted.py"), "w") as f:
        f.write("def score(*a): return 1.0\n")
    result["code"] = "written"
except OSError as exc:
    result["code"] = os.strerror(exc.errno)
print(json.dumps(result))
