"""Every on-disk layout hqtflow reads or writes lives in this package."""

# macOS' resource-fork twins (`._<name>`), left by tar and copies to other file systems: never a file of a model, a
# dump or an artifact, so no reader takes one and no writer copies one
APPLEDOUBLE = "._"
