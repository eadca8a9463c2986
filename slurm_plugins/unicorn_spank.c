/*
 * unicorn_spank.c - SPANK plugin: --unicorn-weight and --unicorn-min-gpus.
 *
 * Adds two options to sbatch, salloc and srun:
 *
 *   --unicorn-weight=W     share of the cluster's weighted throughput, 0.5 .. 2.0
 *   --unicorn-min-gpus=N   GPUs below which the task gains nothing, 1 .. 1000000
 *
 * Contract:
 * - Options are registered with spank_option_register() in slurm_spank_init(), in
 *   every context: sbatch/salloc accept only options registered that way, and the
 *   remote side (slurmstepd) must know them to receive their values.
 * - A bad value makes the option callback fail, so sbatch/salloc/srun exit with an
 *   error before anything is submitted ("unicorn: --unicorn-weight=3: ...").
 * - In slurmstepd (remote context) the values are exported into the job's
 *   environment as UNICORN_WEIGHT and UNICORN_MIN_GPUS (canonical text: "%g" and a
 *   decimal integer), overwriting inherited values, so the batch script (the unicorn
 *   wrapper) and every task see exactly what was asked for.
 * - Accepted syntax is plain decimal only (digits, at most one dot): the same grammar
 *   job_submit.lua and unicorn_core.taskspec accept, so no value passes one check and
 *   fails another. The bounds must equal unicorn_core.taskspec.MIN_WEIGHT/MAX_WEIGHT
 *   (a test compares them).
 *
 * Built by slurm_plugins/install.py: gcc -shared -fPIC against <slurm/spank.h>.
 */

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>

SPANK_PLUGIN(unicorn, 1);

#define UNICORN_MIN_WEIGHT 0.5
#define UNICORN_MAX_WEIGHT 2.0
#define UNICORN_MAX_MIN_GPUS 1000000L
#define UNICORN_MAX_ARG_LEN 16

#define OPT_WEIGHT 1
#define OPT_MIN_GPUS 2

/* Canonical values of the options given; "" when an option was not used. */
static char weight_val[32];
static char min_gpus_val[16];

/* True when s is a plain decimal: digits with at most one dot, at least one digit. */
static int is_plain_decimal(const char *s, int allow_dot)
{
	int digits = 0, dots = 0;
	size_t len;

	if (s == NULL)
		return 0;
	len = strlen(s);
	if (len == 0 || len > UNICORN_MAX_ARG_LEN)
		return 0;
	for (; *s; s++) {
		if (*s >= '0' && *s <= '9')
			digits++;
		else if (*s == '.' && allow_dot && dots == 0)
			dots++;
		else
			return 0;
	}
	return digits > 0;
}

static int parse_weight(const char *arg, double *out)
{
	char *end = NULL;
	double w;

	if (!is_plain_decimal(arg, 1))
		return -1;
	errno = 0;
	w = strtod(arg, &end);
	if (errno != 0 || end == arg || *end != '\0' || !isfinite(w))
		return -1;
	if (w < UNICORN_MIN_WEIGHT || w > UNICORN_MAX_WEIGHT)
		return -1;
	*out = w;
	return 0;
}

static int parse_min_gpus(const char *arg, long *out)
{
	char *end = NULL;
	long n;

	if (!is_plain_decimal(arg, 0))
		return -1;
	errno = 0;
	n = strtol(arg, &end, 10);
	if (errno != 0 || *end != '\0' || n < 1 || n > UNICORN_MAX_MIN_GPUS)
		return -1;
	*out = n;
	return 0;
}

static int option_cb(int val, const char *optarg, int remote)
{
	double w;
	long n;

	(void) remote;
	switch (val) {
	case OPT_WEIGHT:
		if (parse_weight(optarg, &w) != 0) {
			slurm_error("unicorn: --unicorn-weight=%s: must be a decimal number "
				    "between %.1f and %.1f", optarg ? optarg : "",
				    UNICORN_MIN_WEIGHT, UNICORN_MAX_WEIGHT);
			return -1;
		}
		snprintf(weight_val, sizeof(weight_val), "%g", w);
		return 0;
	case OPT_MIN_GPUS:
		if (parse_min_gpus(optarg, &n) != 0) {
			slurm_error("unicorn: --unicorn-min-gpus=%s: must be an integer "
				    "between 1 and %ld", optarg ? optarg : "",
				    UNICORN_MAX_MIN_GPUS);
			return -1;
		}
		snprintf(min_gpus_val, sizeof(min_gpus_val), "%ld", n);
		return 0;
	default:
		slurm_error("unicorn: unknown option value %d", val);
		return -1;
	}
}

static struct spank_option unicorn_options[] = {
	{ "unicorn-weight", "W",
	  "unicorn: the task's weight, 0.5 .. 2.0 (default 1.0)",
	  1, OPT_WEIGHT, (spank_opt_cb_f) option_cb },
	{ "unicorn-min-gpus", "N",
	  "unicorn: fewest GPUs the task can use (default 1)",
	  1, OPT_MIN_GPUS, (spank_opt_cb_f) option_cb },
	SPANK_OPTIONS_TABLE_END
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	struct spank_option *opt;
	spank_err_t rc;

	(void) ac;
	(void) av;
	for (opt = unicorn_options; opt->name != NULL; opt++) {
		rc = spank_option_register(sp, opt);
		if (rc != ESPANK_SUCCESS) {
			slurm_error("unicorn: cannot register --%s: %s", opt->name,
				    spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}

static int export_var(spank_t sp, const char *name, const char *value)
{
	spank_err_t rc;

	if (value[0] == '\0')
		return 0;
	rc = spank_setenv(sp, name, value, 1);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("unicorn: cannot set %s in the job environment: %s", name,
			    spank_strerror(rc));
		return -1;
	}
	return 0;
}

/*
 * Remote context, once per step after the options were processed and before any
 * task starts: the batch step's environment becomes the batch script's.
 */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	(void) ac;
	(void) av;
	if (spank_remote(sp) != 1)
		return 0;
	if (export_var(sp, "UNICORN_WEIGHT", weight_val) != 0)
		return -1;
	return export_var(sp, "UNICORN_MIN_GPUS", min_gpus_val);
}
