#include "worker/text/jinja.h"
