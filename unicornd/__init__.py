"""The coordinator (``unicornd``) and the operator CLI (``unicornctl``). Head node only."""
