"""A checkpoint on local disk: integrity (sizes, CRC64NVME, zip CRCs), loading without running code,
validation at every level, the manifest, the resume point and quarantine, retention, the gate that
admits a step, and the preview of what a resume would load.

May import relay.common, relay.runs and relay.data. Knows nothing of S3: the store (relay.s3) moves
bytes, and takes its rules from here.
"""
