"""The far side of a service stack: the process guard that runs one service's command."""
