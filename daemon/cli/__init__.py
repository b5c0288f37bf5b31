"""The command line: every `hotswap` subcommand, one module per group of commands.

    main      `hotswap`: parses the first word and hands the rest to the module that owns it;
              also `daemon`, `history`, `status`, `db upgrade`, `rollback`, `pin`, `unpin`
    read      `history` and `status`: read-only views of the registry (and the daemon's /status)
    control   how a command reaches the running daemon's control API (address file, token, TLS)
    publish   `publish DIR`: write the manifest, last
    push      `publish --to s3://...` and `push --to https://...` (the trainer's side)
    verify    `verify DIR`: the checks on a directory, without the daemon
    reverify  `reverify VERSION`
    fleet     `fleet target`

May import every other package of the daemon; nothing imports it (tests/project/test_layout.py). A
command imports what it needs when it runs, so `hotswap status` never pays for torch.
"""
