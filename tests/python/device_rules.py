"""A pytest plugin that decides host tensors by the rules gact applies to CUDA tensors, where reading values back
would wait for the device (`tools/dev test` runs the gradient suites with it: `-p device_rules`):

* the calls that select small values (saved.selects_small) tell the sign of a scaled distance from the graph alone,
  a written negation or a negative number, not from the values;
* a normalization input's shift test (compressor._shift_residual_too_large) is measured at step 0 and read at
  step(), applying from the next step;
* a straight-through estimator's result is told by a verdict read at step() (saved.whole_numbers), kept exact from
  the next step.

A machine without a GPU thus checks the device's storage decisions in every gradient test that runs more than one
step."""

import gact.compressor
import gact.saved

gact.saved._DEVICE_RULES_ON_HOST = True
gact.compressor._DEFERRED_CHECKS = True
