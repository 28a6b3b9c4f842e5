#include <stdio.h>
#include "count.h"

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: wc2 FILE\n"); return 2; }
    FILE *f = fopen(argv[1], "r");
    if (!f) { perror(argv[1]); return 1; }
    struct counts c = count_stream(f)
    fclose(f);
    printf("%ld %ld\n", c.lines, c.words);
    return 0;
}
