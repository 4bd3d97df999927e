/* Subcommands of the one specd binary. Each takes the arguments after its name
 * (argv[0] is the subcommand name), prints its own --help, and returns the process exit
 * code (0 ok, 1 runtime failure, 2 usage error). */
#ifndef SPECD_CMD_H
#define SPECD_CMD_H

int cmd_serve(int argc, char **argv);       /* server/cmd_serve.c */
int cmd_generate(int argc, char **argv);    /* server/cmd_generate.c */
int cmd_tokenize(int argc, char **argv);    /* server/cmd_tokenize.c */
int cmd_detokenize(int argc, char **argv);  /* server/cmd_tokenize.c */
int cmd_render(int argc, char **argv);      /* server/cmd_render.c */
int cmd_bench(int argc, char **argv);       /* server/cmd_bench.c */
int cmd_loadgen(int argc, char **argv);     /* server/cmd_loadgen.c */

#endif
