"""A kazurator lock driven over stdin/stdout, for fencelock's interop tests.

usage: kazurator_lock.py HOSTS PATH mutex|read|write TIMEOUT_SECONDS

Tries to take the lock (waiting up to TIMEOUT_SECONDS), prints "acquired" or
"timeout", then (if acquired) waits for a line on stdin, releases, prints
"released" and exits.
"""
import sys

from kazoo.client import KazooClient
from kazoo.exceptions import LockTimeout
from kazurator import Mutex, ReadWriteLock

hosts, path, kind, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
client = KazooClient(hosts=hosts)
client.start(timeout=20)
if kind == "mutex":
    lock = Mutex(client, path, timeout=timeout)
else:
    rw = ReadWriteLock(client, path, timeout=timeout)
    lock = rw.read_lock if kind == "read" else rw.write_lock
try:
    lock.acquire()
except LockTimeout:
    print("timeout", flush=True)
    client.stop()
    sys.exit(0)
print("acquired", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
client.stop()
