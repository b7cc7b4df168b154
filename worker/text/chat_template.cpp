#include "worker/text/chat_template.h"
