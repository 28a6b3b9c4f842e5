#ifndef COUNT_H
#define COUNT_H
#include <stdio.h>

struct counts { long lines; long words; };

struct counts count_stream(FILE *f);
#endif
