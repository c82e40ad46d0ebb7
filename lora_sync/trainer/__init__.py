"""The trainer's side: the client every trainer uses (one or many servers, both engines),
what it remembers between pushes, sharded (FSDP2) pushes, and the command line."""
