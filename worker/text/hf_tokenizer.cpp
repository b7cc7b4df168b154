#include "worker/text/hf_tokenizer.h"
