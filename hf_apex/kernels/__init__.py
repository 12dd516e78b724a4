"""What talks to apex: availability (the one "can it run here, and why not"), the norm modules and their
surgery, the optimizers, and the trace of which implementation ran."""
