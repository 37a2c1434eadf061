"""effectledger dispatcher: claims attempts and makes exactly one provider call per attempt."""
