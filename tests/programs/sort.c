/* qsort and malloc as a program leans on them: records each with a string of its own on the heap (many small
   blocks, some freed and allocated again, some grown with realloc), sorted by qsort on two keys, and a large
   array of integers sorted; checked in order and summed. Its output is the same on any machine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RECORDS 20000
#define NUMBERS 200000

struct record {
	unsigned key;
	char *name;
};

static unsigned long seed = 12345;

static unsigned next(void)
{
	seed = seed * 6364136223846793005UL + 1442695040888963407UL;
	return (unsigned)(seed >> 33);
}

static int by_key_then_name(const void *a, const void *b)
{
	const struct record *x = a, *y = b;

	if (x->key != y->key)
		return x->key < y->key ? -1 : 1;
	return strcmp(x->name, y->name);
}

static int by_value(const void *a, const void *b)
{
	long x = *(const long *)a, y = *(const long *)b;

	return (x > y) - (x < y);
}

int main(void)
{
	struct record *records = malloc(RECORDS * sizeof(*records));
	long *numbers = malloc(NUMBERS * sizeof(*numbers));
	unsigned long sum = 0, order_errors = 0, length = 0;

	if (!records || !numbers)
		return 1;
	for (int i = 0; i < RECORDS; i++) {
		int len = 4 + (int)(next() % 40);

		records[i].key = next() % 1000;
		records[i].name = malloc((size_t)len + 1);
		for (int j = 0; j < len; j++)
			records[i].name[j] = (char)('a' + next() % 26);
		records[i].name[len] = 0;
	}
	for (int i = 0; i < RECORDS; i += 3) {	/* some freed and made again, some grown */
		size_t len = strlen(records[i].name);

		if (i % 2) {
			free(records[i].name);
			records[i].name = malloc(len + 1);
			memset(records[i].name, 'm', len);
			records[i].name[len] = 0;
		} else {
			records[i].name = realloc(records[i].name, len * 3 + 1);
			memcpy(records[i].name + len, records[i].name, len);
			memcpy(records[i].name + 2 * len, records[i].name, len);
			records[i].name[3 * len] = 0;
		}
	}
	qsort(records, RECORDS, sizeof(*records), by_key_then_name);
	for (int i = 0; i < RECORDS; i++) {
		if (i && by_key_then_name(&records[i - 1], &records[i]) > 0)
			order_errors++;
		sum = sum * 31 + records[i].key + (unsigned char)records[i].name[0];
		length += strlen(records[i].name);
	}
	for (int i = 0; i < RECORDS; i++)
		free(records[i].name);
	printf("records sorted: %d, out of order %lu, names %lu bytes, digest %lx\n", RECORDS, order_errors, length,
	       sum);
	for (int i = 0; i < NUMBERS; i++)
		numbers[i] = (long)next() - (1L << 30);
	qsort(numbers, NUMBERS, sizeof(*numbers), by_value);
	sum = 0;
	order_errors = 0;
	for (int i = 0; i < NUMBERS; i++) {
		order_errors += i && numbers[i - 1] > numbers[i];
		sum = sum * 131 + (unsigned long)numbers[i];
	}
	printf("numbers sorted: %d, out of order %lu, smallest %ld, largest %ld, digest %lx\n", NUMBERS, order_errors,
	       numbers[0], numbers[NUMBERS - 1], sum);
	free(records);
	free(numbers);
	return 0;
}
