"""What a server's life reads of its command line, as one typed value (peer/host/options.py)."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import fields

import pytest

from peer.host.options import ServerOptions


def serve_args(tmp_path, *extra: str):
    from peer import serve_flags
    from peer.cli import build_parser
    from peer.runtime import check_common

    argv = ["serve", "--reliable", "--stages", "1", "--stage", "0", "--role", "frontal", "--model", "tiny"]
    args = build_parser().parse_args(argv + ["--run-key", str(tmp_path / "run.key"), *extra])
    check_common(args)
    return args, serve_flags.resolve(args)


def test_the_options_are_what_the_command_line_said(tmp_path):
    args, _ = serve_args(tmp_path, "--checkpoint-dir", str(tmp_path / "ck"), "--task-timeout", "7", "--no-compute")
    options = ServerOptions.from_args(args)
    assert options.checkpoint_dir == str(tmp_path / "ck") and options.task_timeout == 7.0 and options.no_compute
    assert options.initial_peers == [] and options.run_fp == args.run_fp
    # every field is read from the namespace: none is made up
    assert all(
        getattr(options, f.name) == getattr(args, f.name, f.default)
        for f in fields(ServerOptions)
        if f.name != "initial_peers"
    )


def test_a_namespace_without_a_field_the_server_needs_is_named(tmp_path):
    args = vars(serve_args(tmp_path)[0])
    del args["task_timeout"]
    with pytest.raises(AttributeError, match="task_timeout"):
        ServerOptions.from_args(Namespace(**args))


def test_the_server_refuses_the_namespace_itself(tmp_path):
    from peer.host.server import ServerHost

    args, (cfg, layout, device, run_cfg) = serve_args(tmp_path)
    with pytest.raises(TypeError, match="ServerOptions"):
        ServerHost(args, cfg, layout, device, run_cfg)


def test_a_bans_reach_defaults_and_bad_values_are_named(tmp_path):
    from parameter_server.old_versions import DEFAULT_BAN_REACH, DEFAULT_BAN_REACH_GB
    from peer.errors import UsageError

    options = ServerOptions.from_args(serve_args(tmp_path)[0])
    assert (options.ban_reach, options.ban_reach_gb) == (DEFAULT_BAN_REACH, DEFAULT_BAN_REACH_GB)
    options = ServerOptions.from_args(serve_args(tmp_path, "--ban-reach", "0", "--ban-reach-gb", "0.5")[0])
    assert (options.ban_reach, options.ban_reach_gb) == (0, 0.5)
    with pytest.raises(UsageError, match="--ban-reach must be >= 0 versions, got -1"):
        serve_args(tmp_path, "--ban-reach", "-1")
    with pytest.raises(UsageError, match="--ban-reach-gb must be a positive number of GB, got 0.0"):
        serve_args(tmp_path, "--ban-reach-gb", "0")
