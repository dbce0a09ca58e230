"""The participant side of the checkpoint protocol (a kit any aiohttp rollout server mounts).

So far: :mod:`workers.participant.storage` (records file and manifest). The control
routes, episode steps and retire marks come next (issue 3).
"""
