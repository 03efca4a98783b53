"""Inside the jail: reach the gateway, then try what a program phoning home does (a name lookup, a
connection to an address elsewhere), so that the network audit has something to report.

It tries nothing unless the namespace has no interface but loopback, so a broken jail cannot make
it send anything off the machine.
"""

import json
import socket

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
with open("/proc/net/dev") as f:
    interfaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
tried = {}
if interfaces == ["lo"]:
    try:
        socket.getaddrinfo("updates.example.com", 443)
        tried["lookup"] = "resolved"
    except OSError as exc:
        tried["lookup"] = type(exc).__name__
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(("10.255.255.1", 443))
        tried["connect"] = "connected"
    except OSError as exc:
        tried["connect"] = type(exc).__name__
    sock.close()
print(json.dumps({"interfaces": interfaces, "tried": tried}))
