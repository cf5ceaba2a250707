"""A checkpoint on local disk: integrity (sizes, CRC64NVME, zip CRCs), loading without running code,
validation at every level, the manifest, the resume point and quarantine, retention, the gate that
admits a step, reshard, and the preview of what a resume would load.

May import relay.common, relay.runs and relay.data; never the spec: what a check needs of the run's
settings (its smoke function, its settings fingerprint) is handed to it by the caller. Knows nothing of
S3: the store (relay.s3) moves bytes, and takes its rules from here.
"""
