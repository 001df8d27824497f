"""An elastic job: processes of your own join with ``sw.attach(name)`` and leave.

``job.serve(workers=(min, max), name=...)`` serves the shards under a name; any
process of this user joins with ``sw.attach(name)`` (the lowest free worker id)
and leaves with ``client.close()`` or by dying. BSP rounds and SSP bounds follow
the live workers. Here two processes join, push 20 steps each and leave, then a
third joins after them.

    .venv/bin/python examples/elastic_attach.py
"""

import subprocess
import sys

import numpy as np

import stalewise as sw

WORKER = """
import stalewise as sw
client = sw.attach("quadratic")               # joins the served job: the lowest free worker id
for _ in range(20):
    w = client.pull()["w"]
    client.push({"w": w - 3.0})               # the gradient of 0.5 * (w - 3)**2
client.close()                                # leaves: the gates stop counting it, its id is free
"""

if __name__ == "__main__":
    job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with job.serve(workers=(0, 4), name="quadratic") as server:  # room for 4, none expected
        first = [subprocess.Popen([sys.executable, "-c", WORKER]) for _ in range(2)]
        [p.wait() for p in first]
        later = subprocess.Popen([sys.executable, "-c", WORKER])  # joins after they left
        later.wait()
        print(f"w = {server.pull()['w'][0]:.3f} after 60 pushes from 3 processes")
