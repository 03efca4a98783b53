"""One turn, then what it can read of the paths given: a hidden folder's secret, a hidden file,
a file beside them, and its own working directory (argv: folder, file, visible, workdir)."""

import json
import os
import sys

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
folder, hidden_file, visible, workdir = sys.argv[1:5]


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
print(json.dumps(result))
