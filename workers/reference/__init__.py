"""Reference participants: a small multi-step task served by four real processes.

An episode of the reference task takes several turns. Each turn the environment
asks the agent for an action (the agent asks the policy model), then asks the
resources server to verify it; the environment records a boundary after each of
the two steps. Every server is a participant of its kind, checkpointable
mid-episode, and counts how often it executed each step of each episode
(``executions`` in its status), so tests can prove that no step ran twice.

    python -m workers.reference.model --port 8101 --state-dir /var/lib/ref/model
    python -m workers.reference.resources --port 8102 --state-dir /var/lib/ref/resources
    python -m workers.reference.agent --port 8103 --state-dir /var/lib/ref/agent --model http://127.0.0.1:8101
    python -m workers.reference.environment --port 8104 --state-dir /var/lib/ref/env \\
        --agent http://127.0.0.1:8103 --resources http://127.0.0.1:8102

The control token comes from ``TIDELOG_CONTROL_TOKEN`` (required).
"""
