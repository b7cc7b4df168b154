// A step as a scheduler (exegpt/rra_scheduler.h, exegpt/waa_scheduler.h) hands it to the
// stages (stages.h): the command every stage runs and the sequences it starts. Here, beneath
// both, so the seam does not depend on the schedulers that fill it.
#pragma once

#include <vector>

#include "transport/messages.h"

namespace strata {

struct ScheduledStep {
  StepCommand command;         // token ids filled (the first stage's copy)
  std::vector<SeqJoin> joins;  // sequences this prefill starts (for the last stage's sampler)
};

}  // namespace strata
