"""``mlem lease``: run a command on leased GPUs, or show who holds which GPU (host side).

``mlem lease --gpus 2 -- python train.py`` takes two free GPUs of this node
(see :mod:`mlemlib.dist.lease`), sets ``CUDA_VISIBLE_DEVICES`` and replaces
itself with the command, which inherits the lock files: the GPUs stay leased
exactly as long as the command runs, however it ends. ``mlem lease --status``
lists the devices and their holders.
"""

from __future__ import annotations

import argparse
import os
import shutil

from mlemlib.cli._common import add_parser
from mlemlib.errors import EXIT_OK, ConfigError, InputError


def register(sub) -> None:
    """Add the ``lease`` subcommand."""
    p = add_parser(
        sub,
        "lease",
        "Run a command on P free GPUs of this node (per-device lock files), or show the leases.",
        epilog="example: mlem lease --gpus 2 -- mlem reconstruct --gpus 2 ...",
    )
    p.add_argument("-g", "--gpus", type=int, metavar="P", default=1, help="number of GPUs to lease")
    p.add_argument(
        "-t", "--timeout", type=float, metavar="SECONDS", default=600.0, help="wait at most this long for free GPUs"
    )
    p.add_argument(
        "-d",
        "--lock-dir",
        metavar="DIR",
        default=None,
        help="lock directory (node-local; default $MLEM_LOCK_DIR or /tmp/mlem-gpu-locks)",
    )
    p.add_argument("-s", "--status", action="store_true", help="list the devices and who holds them, then exit")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Show the leases, or lease GPUs and exec the command (does not return on success)."""
    from mlemlib.dist import lease as lease_mod

    if args.status:
        for rec in lease_mod.status(args.lock_dir):
            holder = rec["holder"] or {}
            who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('since', '?')}"
            print(f"{rec['device']:>8}  {'held' if rec['held'] else 'free':4}  {who if rec['held'] else ''}")
        return EXIT_OK
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("command", "nothing to run: give a command after --, or --status")
    exe = shutil.which(command[0])
    if exe is None:
        raise InputError(command[0], "command not found")
    lease = lease_mod.acquire(args.gpus, timeout=args.timeout, directory=args.lock_dir)
    env = dict(os.environ)
    env.update(lease_mod.lease_environment(lease))
    for fd in lease.fds:
        os.set_inheritable(fd, True)  # the command holds the locks from now on
    os.execve(exe, command, env)
    return EXIT_OK  # not reached
