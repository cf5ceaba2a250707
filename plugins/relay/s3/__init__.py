"""Checkpoints in S3: the store (checksummed multipart uploads, listing, archive of a run), publication
of a validated step, and the restore of a published step into a run folder.

May import every layer below: relay.common, relay.spec, relay.runs, relay.data, relay.checkpoints.
"""
